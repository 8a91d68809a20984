"""Agent settings: every field is a flag (`--engine-url`) and an env variable (`PDSERVE_ENGINE_URL`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field

from pdserve.common.tls import TLSClientSettings
from pdserve.common.tracing import TracingSettings
from pdserve.scheduler.protocol import instance_id_field, version_field


class AgentSettings(TracingSettings, TLSClientSettings):
    """pdserve agent: registers one vLLM instance with the pdserve scheduler, heartbeats its load, drains it."""

    engine_url: str = Field(pattern=r"^https?://[^/\s]+/?$", description="where the agent reaches vLLM's API server")
    role: Literal["prefill", "decode"] = Field(description="prefill (kv_producer) or decode (kv_consumer)")
    scheduler_url: str = Field(pattern=r"^https?://[^/\s]+/?$", description="scheduler base URL")
    scheduler_token_file: Path = Field(
        description="file holding this instance's scheduler token (principal instance:<instance id>)"
    )
    advertise_url: str = Field(
        pattern=r"^https?://[^/\s]+$",
        description="vLLM's API server as the gateway reaches it, e.g. http://10.0.1.5:8100",
    )
    version: str = version_field()
    connector_run_dir: Path = Field(
        description="PdstackConnector's run_dir (kv_connector_extra_config), where its worker writes instance.json"
    )
    instance_id: str | None = instance_id_field("id to register as; default <role>-<advertise host>-<port>")
    engine_token_file: Path | None = Field(None, description="file holding vLLM's --api-key, if vLLM was given one")
    max_num_seqs: int = Field(128, ge=1, description="vLLM's --max-num-seqs: its request slots")
    heartbeat_seconds: float = Field(2.0, gt=0, description="seconds between heartbeats")
    engine_timeout_seconds: float = Field(2.0, gt=0, description="seconds a call to vLLM (/health, /metrics) may take")
    drain_grace_seconds: float = Field(
        2.0, ge=0, description="on SIGTERM, seconds to wait after draining for the gateways to poll the new table"
    )
    drain_timeout_seconds: float = Field(
        120.0, gt=0, description="on SIGTERM, longest wait for vLLM's running and waiting requests to reach 0"
    )
    log_level: str = Field("info", description="debug | info | warning | error")

    def registered_id(self) -> str:
        if self.instance_id is not None:
            return self.instance_id
        address = urlsplit(self.advertise_url).netloc.replace(":", "-").replace("[", "").replace("]", "")
        return f"{self.role}-{address}"
