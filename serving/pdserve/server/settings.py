"""Server configuration: one typed model, filled from command-line flags, each of which has a PDSERVE_* variable
(pdserve.common.settings)."""

from __future__ import annotations

import importlib.metadata
import uuid
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path

from pydantic import ConfigDict, Field, model_validator

from pdserve.common.settings import is_loopback, load_settings
from pdserve.common.tls import TLSSettings
from pdserve.common.tracing import TracingSettings
from pdserve.kv.settings import KVChannelSettings


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class FailurePolicy(StrEnum):
    RECOMPUTE = "recompute"  # prefill locally when the KV cannot be had
    FAIL = "fail"  # answer an error naming the cause


class ServerSettings(TracingSettings, TLSSettings, KVChannelSettings):
    """Everything a prefill, decode or colocated server needs to start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    model: Path = Field(description="Hugging Face checkpoint directory")
    served_model_name: str | None = Field(None, description="name in /v1/models (default: the directory name)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    advertise_host: str | None = Field(None, description="host decode should pull KV from (default: --host)")
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex, description="this instance's remote_engine_id")
    api_token_file: Path | None = Field(
        None,
        description="bearer token every caller must present (all paths but "
        "/health*, /metrics); required for prefill and decode",
    )
    kv_load_failure_policy: FailurePolicy = FailurePolicy.FAIL
    max_num_seqs: int = Field(64, ge=1, description="requests admitted at once; more get 429")
    max_body_bytes: int = Field(
        4_194_304, ge=1024, description="largest request body read (413 beyond it): the gateway's limit plus room"
    )
    kv_memory_bytes: int = Field(1 << 30, gt=0, description="KV memory for running requests; beyond it 503")
    prefill_token_budget: int = Field(512, ge=16, description="prompt tokens per engine step (chunked prefill)")
    max_model_len: int | None = Field(None, ge=2, description="context limit (default: the model's)")
    scheduler_url: str | None = Field(None, description="register and heartbeat with this pdserve scheduler")
    scheduler_token_file: Path | None = Field(
        None, description="the scheduler's instance token (needed with --scheduler-url)"
    )
    version: str = Field(importlib.metadata.version("pdserve"), description="release reported to the scheduler")
    heartbeat_seconds: float = Field(5.0, gt=0)
    blas_threads: int = Field(
        1,
        ge=1,
        description="BLAS threads per process (1: the engine step, KV hashing and "
        "HTTP share few cores; spinning BLAS threads starve them)",
    )
    log_level: str = "info"
    fault_error_rate: float = Field(0.0, ge=0, le=1, description="fault injection: share of requests failed with 500")
    fault_delay_ms: float = Field(0.0, ge=0, description="fault injection: delay added before every request")
    fault_perturb_output: bool = Field(False, description="fault injection: sample hot instead of the requested way")

    @model_validator(mode="after")
    def _check_role_needs(self) -> ServerSettings:
        if self.role is not Role.COLOCATED and self.kv_key_file is None:
            raise ValueError(f"kv_key_file: the {self.role.value} role needs the KV channel's shared key file")
        if self.role is not Role.COLOCATED and self.api_token_file is None:
            raise ValueError(
                f"api_token_file: the {self.role.value} role serves only callers holding the API token "
                "(the gateway); give its file"
            )
        if self.api_token_file is None and not is_loopback(self.host):
            raise ValueError(
                f"api_token_file: without an API token this server would serve anyone who reaches {self.host}; "
                "give api_token_file, or listen on a loopback address (127.0.0.1, ::1, localhost)"
            )
        if self.scheduler_url is not None and self.scheduler_token_file is None:
            raise ValueError("scheduler_token_file: registering with a scheduler needs its instance token file")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def kv_listen_host(self) -> str:
        """Where the KV channel listens: kv_host, else the address decode is told to pull from (not every one)."""
        return self.kv_host or self.advertised_host


def settings_from_args(role: str, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> ServerSettings:
    """A `role` server's settings from flags and PDSERVE_* variables (pdserve.common.settings); exits naming the flag
    of a bad value."""
    return load_settings(ServerSettings, argv, f"pdserve {role}", environ, fixed={"role": role})
