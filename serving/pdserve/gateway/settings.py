"""Gateway settings: every field is a flag (`--api-keys-file`) and an env variable (`PDSERVE_API_KEYS_FILE`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from pdserve.common.settings import is_loopback
from pdserve.common.tls import TLSSettings
from pdserve.common.tracing import TracingSettings


class GatewaySettings(TracingSettings, TLSSettings):
    """pdserve gateway: OpenAI-compatible entry point running the prefill -> decode flow."""

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    scheduler_url: str = Field(pattern=r"^https?://[^/\s]+/?$", description="scheduler base URL")
    scheduler_token_file: Path = Field(
        description="file holding the gateway's scheduler token (principal gateway, pdserve.scheduler.identity)"
    )
    server_token_file: Path = Field(
        description="file holding the token presented as Authorization: Bearer to prefill and decode servers"
    )
    api_keys_file: Path = Field(description="JSON/YAML file: tenant -> API keys (sha256:<hex> or plaintext)")
    routing_poll_interval: float = Field(0.5, gt=0, description="seconds between routing-table polls")
    offload_threshold_tokens: int = Field(
        256, ge=0, description="prompts with fewer tokens skip remote prefill and are prefilled on decode"
    )
    tokenizer_file: Path | None = Field(
        None, description="tokenizer.json for exact prompt token counts; without it, count UTF-8 bytes / 4"
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="largest request body accepted")
    max_prompt_tokens: int = Field(32_768, ge=1, description="longest prompt accepted, in tokens")
    max_output_tokens: int = Field(4096, ge=1, description="largest max_tokens accepted")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens set on requests that give none")
    requests_per_second: float = Field(10.0, gt=0, description="default per-tenant request rate")
    request_burst: int = Field(20, ge=1, description="default per-tenant request burst")
    tokens_per_minute: int = Field(200_000, ge=1, description="default per-tenant prompt+completion token budget")
    tenant_max_concurrent_requests: int = Field(
        128,
        ge=1,
        description="default requests of one tenant this replica serves at once (a tenant's max_concurrent_requests "
        "in the keys file overrides it), counted from authentication (before the body is read) to the response's "
        "last byte; more get 429",
    )
    rate_limit_storage: str = Field(
        "memory://",
        pattern=r"^(memory|redis|rediss)://",
        description="where rate-limit counters live: memory:// (this process), or redis://host:port/db or "
        "rediss://host:port/db (TLS: the store verified against tls_ca, or the system's CAs, and its host name "
        "checked; tls_client_cert presented when set), shared by every gateway replica; when the store fails, "
        "limits fall back to this process until it answers again",
    )
    rate_limit_password_file: Path | None = Field(None, description="file holding the rate-limit store's password")
    metrics_token_file: Path | None = Field(
        None,
        description="file holding the token /metrics requires (Authorization: Bearer; Prometheus' scrape "
        "credential): the series name tenants, versions and instances; without it /metrics is open, which only a "
        "gateway listening on a loopback address may do",
    )
    connect_timeout: float = Field(2.0, gt=0, description="seconds to connect to an upstream")
    prefill_timeout: float = Field(60.0, gt=0, description="seconds a prefill call may take")
    first_token_timeout: float = Field(60.0, gt=0, description="seconds until decode's first event")
    inter_token_timeout: float = Field(30.0, gt=0, description="seconds allowed between streamed events")
    request_timeout: float = Field(600.0, gt=0, description="seconds a non-streaming decode call may take")
    kv_params_key_file: Path | None = Field(
        None,
        description="file holding the kv_transfer_params key (64 hex characters, derived from the KV channel "
        "key by pdserve.kv.params.derive_params_key); with it, pairs that both registered kv_streaming get prefill "
        "and decode at once (early dispatch)",
    )
    max_connections: int = Field(512, ge=1, description="upstream connection pool size")
    log_level: str = Field("info", description="debug | info | warning | error")
    log_prompts: bool = Field(False, description="log prompt text (debugging only; never on in production)")
    allow_plaintext: bool = Field(
        False,
        description="serve plain HTTP on a non-loopback address when no tls_cert is set (only where the stack says "
        "so: clients could not tell this gateway from another)",
    )

    @model_validator(mode="after")
    def _plaintext_allowed(self) -> GatewaySettings:
        if self.tls_cert is None and not self.allow_plaintext and not is_loopback(self.host):
            raise ValueError(
                f"tls_cert: the gateway serves clients on {self.host}; give tls_cert and tls_key, or set "
                "allow_plaintext to serve plain HTTP there"
            )
        return self

    @model_validator(mode="after")
    def _metrics_guarded(self) -> GatewaySettings:
        if self.metrics_token_file is None and not is_loopback(self.host):
            raise ValueError(
                f"metrics_token_file: without a metrics token the gateway's /metrics (tenants, versions, instances) "
                f"would be open to anyone who reaches {self.host}; give metrics_token_file, or listen on a loopback "
                "address (127.0.0.1, ::1, localhost)"
            )
        return self
