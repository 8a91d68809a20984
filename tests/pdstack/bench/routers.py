"""vllm-router (pip `vllm-router`, the Rust router of vLLM's production stack) as a real process on loopback."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from tests.support.ports import free_port
from tests.support.services import Service

VLLM_ROUTER = Path(sys.executable).with_name("vllm-router")


def vllm_router(prefill: Sequence[str], decode: Sequence[str], server_token: str, log_path: Path) -> Service:
    """`vllm-router --vllm-pd-disaggregation --prefill URL... --decode URL...` on 127.0.0.1 (start it with
    `.start("/health", timeout)`).

    In that mode vllm-router presents `Authorization: Bearer $OPENAI_API_KEY` (its own environment, like vLLM's
    disaggregated proxy) on every call to prefill and decode, never the client's key: `server_token` goes there.
    """
    workers = [arg for url in prefill for arg in ("--prefill", url)]
    workers += [arg for url in decode for arg in ("--decode", url)]
    args = [
        "--vllm-pd-disaggregation",
        *workers,
        "--policy",
        "round_robin",
        "--log-level",
        "warning",
        "--worker-startup-timeout-secs",
        "60",
        # its exporter binds 29000 unless told otherwise
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    return Service("vllm-router", args, log_path, program=[str(VLLM_ROUTER)], env={"OPENAI_API_KEY": server_token})
