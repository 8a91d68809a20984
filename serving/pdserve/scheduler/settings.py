"""Scheduler settings; each field is a flag and a PDSERVE_* variable (pdserve.common.settings)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from pdserve.common.tls import TLSSettings
from pdserve.common.tracing import TracingSettings

from .protocol import sts_regional_url

# A node role's ARN, the key of join_node_roles (its path, if any, is ignored: an assumed role's ARN has none)
ROLE_ARN = re.compile(r"arn:(aws[a-z-]*):iam::(\d{12}):role/(?:[\w+=,.@/-]*/)?([\w+=,.@-]{1,64})")
JOIN_COMPONENTS = ("prefill", "decode")


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
    # Nodes joining by themselves (POST /v1/join, pdserve.scheduler.join); off while join_node_roles is empty.
    join_node_roles: dict[str, str] = Field(
        default_factory=dict,
        description="node roles that may join, ROLE_ARN=COMPONENT[,...] (or a JSON object): the instance role of a "
        "pool's nodes and the component (prefill, decode) its instances are named by; empty: no joins",
    )
    join_audience: str = Field(
        "",
        max_length=128,
        pattern=r"^[A-Za-z0-9._:/-]*$",
        description="the value a node's signed request must carry in X-Pdstack-Scheduler-Audience (this "
        "scheduler's name, e.g. pdstack-<env>-scheduler); required with join_node_roles",
    )
    join_region: str = Field(
        "", pattern=r"^([a-z]{2}(-[a-z]+)+-\d)?$", description="the region whose STS endpoint join replays to"
    )
    join_sts_url: str = Field(
        "",
        pattern=r"^(https?://[^/?#\s]+/?)?$",
        description="the STS endpoint join replays to, overriding join_region's https://sts.<region>.amazonaws.com/ "
        "(a local one, say); nothing else is ever called",
    )
    join_sts_timeout: float = Field(5.0, gt=0, le=60, description="seconds a join waits for STS")
    join_max_concurrent: int = Field(8, ge=1, le=256, description="joins in progress at once (429 beyond)")

    @field_validator("join_node_roles", mode="before")
    @classmethod
    def _role_pairs(cls, raw: Any) -> Any:
        """ROLE_ARN=COMPONENT pairs separated by commas, or a JSON object, as a flag or variable gives them."""
        if not isinstance(raw, str):
            return raw
        text = raw.strip()
        if text.startswith("{"):
            return json.loads(text)
        pairs = [part.strip() for part in text.split(",") if part.strip()]
        roles: dict[str, str] = {}
        for pair in pairs:
            arn, equals, component = pair.partition("=")
            if not equals:
                raise ValueError(f"expected ROLE_ARN=COMPONENT, got {pair!r}")
            roles[arn.strip()] = component.strip()
        return roles

    @field_validator("join_node_roles")
    @classmethod
    def _roles_valid(cls, roles: dict[str, str]) -> dict[str, str]:
        for arn, component in roles.items():
            if ROLE_ARN.fullmatch(arn) is None:
                raise ValueError(f"{arn!r} is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)")
            if component not in JOIN_COMPONENTS:
                raise ValueError(f"{arn}: component {component!r} is not one of {', '.join(JOIN_COMPONENTS)}")
        return roles

    @model_validator(mode="after")
    def _join_complete(self) -> SchedulerSettings:
        if self.join_node_roles and not self.join_audience:
            raise ValueError("join_node_roles needs join_audience (the value nodes sign for this scheduler)")
        if self.join_node_roles and not (self.join_sts_url or self.join_region):
            raise ValueError("join_node_roles needs join_region (or join_sts_url): where STS is")
        return self

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> SchedulerSettings:
        if not self.scale_down_utilisation < self.target_utilisation <= self.scale_up_utilisation:
            raise ValueError("need scale_down_utilisation < target_utilisation <= scale_up_utilisation")
        return self

    def dead_after(self) -> float:
        return self.heartbeat_interval * self.missed_heartbeats

    def sts_url(self) -> str:
        """The one STS endpoint join replays to."""
        return self.join_sts_url or sts_regional_url(self.join_region)

    def node_roles(self) -> dict[tuple[str, str, str], str]:
        """(partition, account, role name) -> component, as an assumed role's ARN names them."""
        found: dict[tuple[str, str, str], str] = {}
        for arn, component in self.join_node_roles.items():
            match = ROLE_ARN.fullmatch(arn)
            assert match is not None  # checked when loaded
            found[match.group(1), match.group(2), match.group(3)] = component
        return found
