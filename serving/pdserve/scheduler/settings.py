"""Scheduler settings; each field is a flag and a PDSERVE_* variable (pdserve.common.settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from pdserve.common.tls import TLSSettings
from pdserve.common.tracing import TracingSettings


class SchedulerSettings(TracingSettings, TLSSettings):
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
    max_body_bytes: int = Field(
        262_144, ge=1024, description="largest request body read (413 beyond it), after authentication"
    )
    log_level: str = Field("info", description="debug | info | warning | error")

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> SchedulerSettings:
        if not self.scale_down_utilisation < self.target_utilisation <= self.scale_up_utilisation:
            raise ValueError("need scale_down_utilisation < target_utilisation <= scale_up_utilisation")
        return self

    def dead_after(self) -> float:
        return self.heartbeat_interval * self.missed_heartbeats
