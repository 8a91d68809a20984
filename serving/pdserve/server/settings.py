"""Server configuration: one typed model, filled from command-line flags, each of which has a PDSERVE_* variable."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import uuid
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, model_validator

from pdserve.common.tracing import TracingSettings


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class FailurePolicy(StrEnum):
    RECOMPUTE = "recompute"  # prefill locally when the KV cannot be had
    FAIL = "fail"  # answer an error naming the cause


class ServerSettings(TracingSettings):
    """Everything a prefill, decode or colocated server needs to start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    model: Path = Field(description="Hugging Face checkpoint directory")
    served_model_name: str | None = Field(None, description="name in /v1/models (default: the directory name)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    kv_host: str = Field("0.0.0.0", description="address the KV channel listens on (prefill)")  # noqa: S104
    kv_port: int = Field(14579, ge=0, le=65535, description="KV channel port (prefill); 0 picks a free one")
    advertise_host: str | None = Field(None, description="host decode should pull KV from (default: --host)")
    engine_id: str = Field(default_factory=lambda: uuid.uuid4().hex, description="this instance's remote_engine_id")
    kv_key_file: Path | None = Field(None, description="shared KV-channel key (prefill and decode)")
    api_token_file: Path | None = Field(
        None,
        description="bearer token every caller must present (all paths but "
        "/health*, /metrics); required for prefill and decode",
    )
    kv_tls_cert: Path | None = None
    kv_tls_key: Path | None = None
    kv_tls_ca: Path | None = Field(None, description="CA bundle decode trusts for the KV channel")
    kv_tls_server_name: str | None = None
    kv_lease_seconds: float = Field(30.0, gt=0)
    kv_store_bytes: int = Field(1 << 30, gt=0, description="KV held under lease at most (prefill)")
    kv_streams: int = Field(4, ge=1, le=64)
    kv_connect_timeout_seconds: float = Field(5.0, gt=0)
    kv_read_timeout_seconds: float = Field(10.0, gt=0)
    kv_load_failure_policy: FailurePolicy = FailurePolicy.FAIL
    max_num_seqs: int = Field(64, ge=1, description="requests admitted at once; more get 429")
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
        if self.scheduler_url is not None and self.scheduler_token_file is None:
            raise ValueError("scheduler_token_file: registering with a scheduler needs its instance token file")
        if (self.kv_tls_cert is None) != (self.kv_tls_key is None):
            raise ValueError("kv_tls_cert and kv_tls_key: give both or neither")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host


# flag name -> (help, type); every flag reads PDSERVE_<NAME> when not given.
_FIELDS_AS_FLAGS = [name for name in ServerSettings.model_fields if name != "role"]


def env_name(field: str) -> str:
    return "PDSERVE_" + field.upper()


def build_parser(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"pdserve {role}",
        description=f"Run a pdserve {role} server. Every option can also be set by its PDSERVE_* environment variable.",
    )
    for name in _FIELDS_AS_FLAGS:
        info = ServerSettings.model_fields[name]
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, default=None, help=f"{info.description or ''} [env {env_name(name)}]")
    return parser


def settings_from_args(role: str, argv: Sequence[str], environ: dict[str, str] | None = None) -> ServerSettings:
    """Flags win over environment variables, which win over defaults. Raises SystemExit with a clear message."""
    environ = dict(os.environ) if environ is None else environ
    args = build_parser(role).parse_args(list(argv))
    values: dict[str, Any] = {"role": role}
    for name in _FIELDS_AS_FLAGS:
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name] = flag_value
        elif env_name(name) in environ:
            values[name] = environ[env_name(name)]
    try:
        return ServerSettings.model_validate(values)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in item['loc']) or 'settings'}: {item['msg']}" for item in error.errors()
        )
        raise SystemExit(f"pdserve {role}: invalid configuration: {problems}") from None
