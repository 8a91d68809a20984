"""The typed stack model: one Pulumi stack file describes one datacenter of one environment.

A stack file is a Pulumi stack config file (`stacks/Pulumi.<env>-<dc>.yaml`); the project's keys live under
the `pdstack:` namespace, so `pulumi up` reads the very values `pdstack validate` checked. Settings that hold for
the whole environment (serving, canary, secrets, capacity) live in the control-plane datacenter's stack, once.

The model is split by concern: base.py (the strict base and scalar types), topology.py (environment, datacenter,
pools, links), serving_engine.py (pdserve or vLLM, and the vLLM release), serving.py (`pdstack:serving`) and
environment_wide.py (canary, secrets, capacity, alerting); this module holds StackConfig, the whole stack file, and
names every part's public names, so `from pdstack.model import X` works for each of them.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import model_validator

from pdstack.model.base import NAME_PATTERN, Name, Percent, Port, Seconds, Strict
from pdstack.model.environment_wide import (
    REQUIRED_SECRETS,
    RETIRED_SECRETS,
    WEBHOOK_URL_MAX,
    Alerting,
    Canary,
    CanaryThresholds,
    Capacity,
    PulumiSecret,
    Secret,
    default_secrets,
    webhook_url_problem,
)
from pdstack.model.serving import Limits, Model, Ports, Serving, Timeouts, Tracing
from pdstack.model.serving_engine import (
    ALL2ALL_BACKENDS,
    EXTRA_FLAGS,
    IMAGE_BY_DIGEST,
    OWNED_FLAGS,
    VERSION_IN_TAG,
    Engine,
    ExtraValue,
    KvConnector,
    Vllm,
    VllmDtype,
    VllmRole,
)
from pdstack.model.topology import (
    AWS_REGION_PATTERN,
    LOCAL_REGION,
    Datacenter,
    DatacenterRole,
    Environment,
    Link,
    LinkKind,
    NodePool,
    Placement,
    PoolRole,
)

__all__ = [
    "ALL2ALL_BACKENDS",
    "AWS_REGION_PATTERN",
    "EXTRA_FLAGS",
    "IMAGE_BY_DIGEST",
    "LOCAL_REGION",
    "NAME_PATTERN",
    "OWNED_FLAGS",
    "REQUIRED_SECRETS",
    "RETIRED_SECRETS",
    "VERSION_IN_TAG",
    "WEBHOOK_URL_MAX",
    "Alerting",
    "Canary",
    "CanaryThresholds",
    "Capacity",
    "Datacenter",
    "DatacenterRole",
    "Engine",
    "Environment",
    "ExtraValue",
    "KvConnector",
    "Limits",
    "Link",
    "LinkKind",
    "Model",
    "Name",
    "NodePool",
    "Percent",
    "Placement",
    "PoolRole",
    "Port",
    "Ports",
    "PulumiSecret",
    "Seconds",
    "Secret",
    "Serving",
    "StackConfig",
    "Strict",
    "Timeouts",
    "Tracing",
    "Vllm",
    "VllmDtype",
    "VllmRole",
    "webhook_url_problem",
]


class StackConfig(Strict):
    """Everything under `pdstack:` in one stack file."""

    environment: Environment
    datacenter: Datacenter
    serving: Serving | None = None
    canary: Canary | None = None
    secrets: list[Secret] | None = None
    capacity: Capacity | None = None
    alerting: Alerting | None = None

    ENVIRONMENT_WIDE: ClassVar[tuple[str, ...]] = ("serving", "canary", "secrets", "capacity", "alerting")

    @model_validator(mode="after")
    def _environment_wide_settings_on_control(self) -> StackConfig:
        if self.datacenter.role is DatacenterRole.CONTROL:
            if self.serving is None:
                raise ValueError("the control-plane stack must set `serving`")
            names = {s.name for s in self.secret_specs}
            retired = [f"{name} is retired ({why})" for name, why in RETIRED_SECRETS.items() if name in names]
            if retired:
                raise ValueError(f"pdstack:secrets: {'; '.join(retired)}")
            missing = [name for name in REQUIRED_SECRETS if name not in names]
            if missing:
                raise ValueError(
                    f"pdstack:secrets lacks {', '.join(missing)}: the serving runtime reads "
                    f"{', '.join(REQUIRED_SECRETS)}"
                )
        else:
            misplaced = [key for key in self.ENVIRONMENT_WIDE if getattr(self, key) is not None]
            if misplaced:
                raise ValueError(
                    f"pdstack:{', pdstack:'.join(misplaced)} must be set in the control-plane stack, "
                    f"not in a {self.datacenter.role} one"
                )
        return self

    @property
    def secret_specs(self) -> list[Secret]:
        return self.secrets if self.secrets is not None else default_secrets()
