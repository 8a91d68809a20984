"""pdserve agent: a sidecar that puts one vLLM instance in pdserve's scheduler.

    pdserve agent --engine-url http://127.0.0.1:8100 --role prefill --scheduler-url http://scheduler:8200 \\
        --scheduler-token-file /run/secrets/scheduler-token --advertise-url http://10.0.1.5:8100 --version v3 \\
        --connector-run-dir /run/pdstack-vllm

It registers the instance (URL, KV endpoint, version, KV fingerprint and kv_streaming from the connector's
instance.json), reports it ready only while vLLM's /health is 200, heartbeats its load from vLLM's /metrics, and on
SIGTERM drains it: the scheduler routes nothing new to it, the agent waits (bounded) for vLLM's running and
waiting requests to reach 0, deregisters and exits 0. See serving/pdserve/vllm/AGENT.md.

It imports only pydantic, httpx and prometheus_client (no numpy, no vLLM), so it runs in vLLM's environment as in
pdserve's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdserve.common.logs import configure
from pdserve.common.settings import load_settings
from pdserve.common.tracing import configure_tracing

from .settings import AgentSettings


def main(argv: Sequence[str]) -> None:
    from .run import serve  # noqa: PLC0415  (after the settings, so --help needs nothing else)

    settings = load_settings(AgentSettings, argv, prog="pdserve agent")
    configure("agent", settings.log_level)
    configure_tracing("agent", settings)
    try:
        asyncio.run(serve(settings))
    except ValueError as exc:  # an unreadable token file, named by its field
        raise SystemExit(f"pdserve agent: {exc}") from None
