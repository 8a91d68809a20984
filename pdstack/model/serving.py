"""How the environment serves: the model, the engine, ports, limits, timeouts, the KV channel's knobs and tracing
(`pdstack:serving`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pdserve.kv.settings import KV_PORT, KVChannelSettings
from pdstack.model.base import Port, Seconds, Strict
from pdstack.model.environment_wide import webhook_url_problem
from pdstack.model.serving_engine import Engine, Vllm

_KV = KVChannelSettings.model_fields  # the KV channel's knobs: their defaults are pdserve's


class Ports(Strict):
    gateway: Port = 8000
    scheduler: Port = 8100
    prefill: Port = 8200
    decode: Port = 8300
    kv: Port = KV_PORT
    prometheus: Port = 9090

    @model_validator(mode="after")
    def _distinct(self) -> Ports:
        values = list(self.model_dump().values())
        if len(set(values)) != len(values):
            raise ValueError("ports must be distinct")
        return self


class Limits(Strict):
    max_prompt_tokens: int = Field(default=8192, ge=1)
    max_output_tokens: int = Field(default=2048, ge=1)
    max_batch_size: int = Field(default=64, ge=1, description="sequences in one decode step")
    prefill_token_budget: int = Field(
        default=8192, ge=1, description="prompt tokens per prefill step (chunked prefill)"
    )
    max_concurrency: int = Field(default=256, ge=1, description="requests in flight per instance before 429")


class Timeouts(Strict):
    """The gateway's and the KV channel's timeouts; the KV ones reach both engines on both sides
    (pdstack.contract.components) under pdserve's KV channel names, with pdserve's defaults (pdserve.kv.settings)."""

    connect_s: Seconds = Field(default=2.0, description="to connect to an upstream: the gateway's calls, KV pulls")
    prefill_s: Seconds = 30.0
    first_token_s: Seconds = 30.0
    request_s: Seconds = 300.0
    kv_read_s: Seconds = Field(
        default=_KV["kv_read_timeout_seconds"].default,
        description="longest wait for a KV frame on either side (kv_read_timeout_seconds)",
    )
    kv_transfer_s: Seconds = Field(
        default=_KV["kv_transfer_timeout_seconds"].default,
        description="longest a whole KV pull may take (kv_transfer_timeout_seconds)",
    )
    kv_lease_s: Seconds = Field(
        default=_KV["kv_lease_seconds"].default,
        description="how long prefill holds KV no decode pulled (kv_lease_seconds)",
    )


class Model(Strict):
    name: str = Field(min_length=1, description="served model name, as clients ask for it")
    path: str = Field(min_length=1, description="checkpoint directory on the nodes (Hugging Face layout)")
    revision: str = Field(default="main", min_length=1)


class Tracing(Strict):
    """OpenTelemetry traces of every request (docs/tracing.md): gateway, prefill, the KV pull and decode export their
    spans over OTLP/HTTP to `otlp_endpoint`; without this section nothing is traced."""

    otlp_endpoint: str = Field(description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces")
    sample_ratio: float = Field(default=1.0, gt=0, le=1, description="share of requests whose trace is kept")
    include_prompts: bool = Field(default=False, description="prompt text in the gateway's span (debugging only)")

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_endpoint(cls, url: str) -> str:
        problem = webhook_url_problem(url, secret=False)
        if problem is not None:
            raise ValueError(f"the URL {problem}")
        return url


class Serving(Strict):
    model: Model
    engine: Engine = Engine.PDSERVE
    vllm: Vllm | None = None
    ports: Ports = Ports()
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    offload_threshold_tokens: int = Field(
        default=256, ge=0, description="prompts shorter than this are prefilled on decode (selective offload)"
    )
    kv_streams: int = Field(
        default=_KV["kv_streams"].default, ge=1, le=64, description="parallel TCP connections per KV pull (kv_streams)"
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    tracing: Tracing | None = None
    allow_plaintext: bool = Field(
        default=False,
        description="let gateways deployed by Ansible serve plain HTTP on a node's address (pdserve refuses to "
        "without a certificate otherwise): the local environment's, until `make up` makes its CA",
    )
    mutual_tls: bool = Field(
        default=False,
        description="the internal listeners (scheduler, prefill, decode, colocated) require a client certificate "
        "from the environment's CA (PDSERVE_TLS_CLIENT_AUTH=required), which every caller presents; the gateway keeps "
        "server-only TLS and API keys (docs/tls.md)",
    )

    @model_validator(mode="after")
    def _engine_settings(self) -> Serving:
        if self.engine is Engine.VLLM and self.vllm is None:
            raise ValueError("serving.vllm is required when serving.engine is vllm (image, version, max_model_len)")
        if self.engine is Engine.PDSERVE and self.vllm is not None:
            raise ValueError("serving.vllm is set but serving.engine is pdserve: set engine: vllm, or remove it")
        return self
