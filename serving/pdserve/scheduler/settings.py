"""Scheduler settings, and the flag/env loader both control-plane services use.

Every field is a flag (`--state-file`) and an environment variable (`PDSERVE_STATE_FILE`); the flag wins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, Field, ValidationError, model_validator

from pdserve.common.tracing import TracingSettings

ENV_PREFIX = "PDSERVE_"
M = TypeVar("M", bound=BaseModel)


def load_settings(model: type[M], argv: Sequence[str], prog: str, env: Mapping[str, str] | None = None) -> M:
    """Build `model` from flags, then PDSERVE_* env variables, then defaults; bad values exit naming the flag."""
    environ = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog=prog, description=model.__doc__)
    for name, field in model.model_fields.items():
        env_key = ENV_PREFIX + name.upper()
        default = "required" if field.is_required() else f"default {field.default!r}"
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            help=f"{field.description or ''} (env {env_key}; {default})",
        )
    namespace = parser.parse_args(list(argv))
    values: dict[str, object] = {}
    for name in model.model_fields:
        flag_value = getattr(namespace, name)
        env_value = environ.get(ENV_PREFIX + name.upper())
        if flag_value is not None:
            values[name] = flag_value
        elif env_value is not None:
            values[name] = env_value
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"--{'.'.join(str(p) for p in err['loc']).replace('_', '-')}: {err['msg']}" for err in exc.errors()
        )
        parser.error(problems)
        raise  # unreachable: parser.error exits


class SchedulerSettings(TracingSettings):
    """pdserve scheduler: instance registry, routing table, version weights, P:D advice."""

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8200, ge=0, le=65535, description="port to listen on (0 picks a free one)")
    state_file: Path = Field(description="JSON file the version weights persist to (written atomically)")
    admin_token_file: Path = Field(description="file holding the bearer token of the admin API")
    identity_key_file: Path = Field(
        description="file holding the key every principal token (instance:<id>, gateway) is derived from "
        "(pdserve.scheduler.identity); must differ from the admin token"
    )
    heartbeat_interval: float = Field(2.0, gt=0, description="seconds between heartbeats that instances are told")
    missed_heartbeats: int = Field(3, ge=1, description="heartbeats missed before an instance is declared dead")
    forget_dead_after: float = Field(300.0, gt=0, description="seconds after which a dead instance is dropped")
    target_utilisation: float = Field(0.6, gt=0, le=1, description="utilisation the P:D advice sizes each role for")
    scale_up_utilisation: float = Field(0.8, gt=0, le=1, description="above this a role should scale up")
    scale_down_utilisation: float = Field(0.3, ge=0, lt=1, description="below this a role may scale down")
    log_level: str = Field("info", description="debug | info | warning | error")

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> SchedulerSettings:
        if not self.scale_down_utilisation < self.target_utilisation <= self.scale_up_utilisation:
            raise ValueError("need scale_down_utilisation < target_utilisation <= scale_up_utilisation")
        return self

    def dead_after(self) -> float:
        return self.heartbeat_interval * self.missed_heartbeats
