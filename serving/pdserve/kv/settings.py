"""The KV channel's settings, one model for both engines: pdserve's servers read them as PDSERVE_* variables and flags
(pdserve.server.settings), PdstackConnector as keys of vLLM's kv_connector_extra_config (pdserve.vllm.settings),
under the same names and defaults. pdstack builds one from the stack and renders it for each
(pdstack.contract.components)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ConfigDict, Field, model_validator

from pdserve.kv.admission import KVListenerSettings

KV_PORT = 8400  # the stack's default too (pdstack.model Ports.kv)


class KVChannelSettings(KVListenerSettings):
    """Prefill's KV listener and decode's pulls: the key, the port, streams, leases and every timeout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_key_file: Path | None = Field(None, description="the KV channel's shared key (prefill and decode)")
    kv_host: str | None = Field(
        None, description="address prefill's KV listener binds (default: the advertised host, not every address)"
    )
    kv_port: int = Field(KV_PORT, ge=0, le=65535, description="prefill's KV port (0 picks a free one: pdserve only)")
    kv_streams: int = Field(4, ge=1, le=64, description="parallel connections of one pull at most (decode)")
    kv_lease_seconds: float = Field(30.0, gt=0, description="how long prefill holds KV that no decode pulled")
    kv_store_bytes: int = Field(1 << 30, gt=0, description="KV held under lease at most (prefill)")
    kv_connect_timeout_seconds: float = Field(5.0, gt=0, description="to connect and authenticate (decode)")
    kv_read_timeout_seconds: float = Field(
        10.0, gt=0, description="longest wait for a frame, on either side, before the peer is taken for gone"
    )
    kv_transfer_timeout_seconds: float = Field(120.0, gt=0, description="longest a whole pull may take (decode)")
    kv_tls_cert: Path | None = Field(None, description="prefill's KV certificate (with kv_tls_key: TLS)")
    kv_tls_key: Path | None = None
    kv_tls_ca: Path | None = Field(
        None, description="CA the peer must chain to (decode checks prefill's; with it prefill requires a client cert)"
    )
    kv_tls_server_name: str | None = Field(None, description="name decode verifies prefill's certificate for")

    @model_validator(mode="after")
    def _tls_pair(self) -> KVChannelSettings:
        if (self.kv_tls_cert is None) != (self.kv_tls_key is None):
            raise ValueError("kv_tls_cert: give it with kv_tls_key, or neither")
        return self
