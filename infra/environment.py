"""What one stack knows about its environment: its own typed config, and the other datacenters' stack files.

A stack's own settings come from Pulumi config (`pdstack:*`), validated into the same pydantic model
`pdstack validate` uses. The rest of the environment (peer regions and CIDRs, which links exist, the serving
ports the control plane fixes) comes from the sibling stack files in the project's `stacks/` folder: configuration
is known before anything is deployed. Cloud identifiers (VPC, route tables, keys) come from StackReferences.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pulumi
from pydantic import ValidationError

from infra.dns import dns_domain_problem
from infra.node_pool import node_image_problem
from pdstack.contract.components import DNS_DOMAIN
from pdstack.model import LOCAL_REGION, DatacenterRole, Environment, Link, Ports, StackConfig
from pdstack.node.config import SsmAgentPin
from pdstack.stacks.validate import validate

PROJECT_ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "pdstack"
SETTINGS_NAMESPACE = "pdstack-infra"
CAPACITY_WAIT_MAX_MINUTES = 240
OBJECT_KEYS = ("datacenter", "serving", "canary", "secrets", "capacity")

# Stacks go up in this order: secrets and the KMS key live in the control plane, prefill sides exist before
# decode sides, and each link is built by its later end, which finds the earlier one by StackReference.
DEPLOY_RANK = {DatacenterRole.CONTROL: 0, DatacenterRole.PREFILL: 1, DatacenterRole.MIXED: 2, DatacenterRole.DECODE: 3}


class ConfigError(pulumi.RunError):
    """The stack's configuration cannot be deployed; the message names the field."""


@dataclass(frozen=True)
class InfraSettings:
    """Deployment knobs that are not part of the serving model (Pulumi config namespace `pdstack-infra`)."""

    kubernetes_version: str = "1.33"
    availability_zones: list[str] | None = None
    eks_public_access_cidrs: list[str] = field(default_factory=list)
    lustre_capacity_gib: int = 0
    ssh_key_name: str | None = None
    release: str = "0.1.0"
    # How long `pulumi up` waits for each GPU pool's desired instances to be InService (infra/node_pool.py); a
    # pool that cannot get its capacity in that time fails the update instead of reporting success with none.
    capacity_wait_minutes: int = 30
    # The GPU nodes' image, pinned (infra/node_pool.py): an AMI id, or an SSM parameter naming one image forever.
    # Required of every stack with GPU pools; the control stack's nodes are EKS's.
    node_image: str | None = None
    # The SSM agent the GPU nodes install at boot (Debian's image has none; docs/cloud.md, "The way in"): AWS's .deb
    # of pdstack-infra:ssm_agent_version, refused unless its sha256 is pdstack-infra:ssm_agent_sha256. Both or neither;
    # without them a node installs no agent and no operator's session reaches it (`pulumi up` warns).
    ssm_agent: SsmAgentPin | None = None
    dns_domain: str = DNS_DOMAIN  # the private zones are <env>.<dns_domain> (read by the control-plane stack)
    # The pipeline's roles (docs/cloud.md, "Reaching the cluster"): EKS access entries make the deploy role cluster
    # admin and the plan role (preview, nightly refresh) a viewer. Required of every control stack.
    deploy_role_arn: str | None = None
    plan_role_arn: str | None = None
    # Stateful resources (KMS keys, the zone, the cluster, buckets, secrets) are protected: `pulumi destroy` or a
    # replacement stops at them. Only a dev stack may turn it off (pdstack-infra:protect false).
    protect: bool = True


@dataclass(frozen=True)
class EnvironmentView:
    this: StackConfig
    datacenters: dict[str, StackConfig]
    settings: InfraSettings

    @property
    def env(self) -> str:
        return str(self.this.environment)

    @property
    def name(self) -> str:
        return self.this.datacenter.name

    @property
    def control(self) -> StackConfig:
        return next(c for c in self.datacenters.values() if c.datacenter.role is DatacenterRole.CONTROL)

    @property
    def ports(self) -> Ports:
        serving = self.control.serving
        assert serving is not None  # the model requires it on the control stack
        return serving.ports

    def stack_of(self, dc: str) -> str:
        return f"{self.env}-{dc}"

    def links(self) -> dict[str, Link]:
        """Every link touching this datacenter, whichever side declares it, keyed by the peer's name."""
        found = {link.peer: link for link in self.this.datacenter.links}
        for name, cfg in self.datacenters.items():
            for link in cfg.datacenter.links:
                if link.peer == self.name and name not in found:
                    found[name] = link.model_copy(update={"peer": name})
        return dict(sorted(found.items()))

    def builds_link_to(self, peer: str) -> bool:
        """The later end of a link in deploy order builds it (both ends' routes), so its peer already exists."""
        return deploy_key(self.this) > deploy_key(self.datacenters[peer])

    def linked_with_role(self, *roles: DatacenterRole) -> list[StackConfig]:
        return [self.datacenters[p] for p in self.links() if self.datacenters[p].datacenter.role in roles]


def deploy_key(cfg: StackConfig) -> tuple[int, str]:
    return DEPLOY_RANK[cfg.datacenter.role], cfg.datacenter.name


def load() -> EnvironmentView:
    this = own_config()
    if this.datacenter.region == LOCAL_REGION or this.environment is Environment.LOCAL:
        raise ConfigError(
            f"stack {pulumi.get_stack()}: the local environment is not deployed by Pulumi; "
            "it runs on this machine through Ansible (`make up`)"
        )
    expected = f"{this.environment}-{this.datacenter.name}"
    if pulumi.get_stack() != expected:
        raise ConfigError(f"stack {pulumi.get_stack()!r} holds datacenter {expected!r}; name the stack {expected!r}")
    return EnvironmentView(this=this, datacenters=sibling_configs(this), settings=infra_settings())


def own_config() -> StackConfig:
    config = pulumi.Config(NAMESPACE)
    raw: dict[str, Any] = {"environment": config.require("environment")}
    for key in OBJECT_KEYS:
        value = config.get_object(key)
        if value is not None:
            raw[key] = value
    try:
        return StackConfig.model_validate_json(json.dumps(raw))
    except ValidationError as exc:
        lines = [f"{NAMESPACE}:{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("invalid stack configuration:\n" + "\n".join(lines)) from None


def sibling_configs(this: StackConfig, stacks_dir: Path | None = None) -> dict[str, StackConfig]:
    """The environment's stack files, checked as `pdstack validate` checks them; this stack's own config wins."""
    folder = stacks_dir or PROJECT_ROOT / "stacks"
    paths = sorted(folder.glob(f"Pulumi.{this.environment}-*.yaml"))
    report = validate(paths)
    if not report.valid:
        raise ConfigError("environment stack files are invalid:\n" + "\n".join(map(str, sorted(report.problems))))
    configs = {s.config.datacenter.name: s.config for s in report.stacks}
    configs[this.datacenter.name] = this
    return configs


def string_list(value: object) -> list[str] | None:
    """A config list as strings; None when the value is absent or not a list."""
    if not isinstance(value, list):
        return None
    return [str(item) for item in cast("list[object]", value)]


IAM_ROLE_ARN = re.compile(r"^arn:aws(-[a-z]+)*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")


def role_arn_problem(value: str) -> str | None:
    """Why `value` is not an IAM role's ARN (arn:<partition>:iam::<12-digit account>:role/<path and name>)."""
    if IAM_ROLE_ARN.match(value):
        return None
    return f"{value!r} is not an IAM role ARN (arn:aws:iam::<12-digit account>:role/<name>)"


def pipeline_role_arn(config: pulumi.Config, key: str) -> str | None:
    value = config.get(key) or None
    problem = role_arn_problem(value) if value is not None else None
    if problem is not None:
        raise ConfigError(f"{SETTINGS_NAMESPACE}:{key}: {problem}")
    return value


def protect_setting(config: pulumi.Config) -> bool:
    """pdstack-infra:protect, true unless a dev stack turns it off; staging and prod are always protected."""
    protect = config.get_bool("protect")
    environment = pulumi.Config(NAMESPACE).get("environment")
    if protect is False and environment != Environment.DEV:
        raise ConfigError(
            f"{SETTINGS_NAMESPACE}:protect: only a dev stack may leave its stateful resources (KMS keys, the zone, "
            f"the cluster, buckets, secrets) unprotected, not {environment}"
        )
    return protect is not False


def infra_settings() -> InfraSettings:
    config = pulumi.Config(SETTINGS_NAMESPACE)
    zones_given = config.get_object("availability_zones")
    zones = string_list(zones_given)
    cidrs = string_list(config.get_object("eks_public_access_cidrs") or [])
    if zones_given is not None and (zones is None or len(zones) != 2):
        raise ConfigError(f"{SETTINGS_NAMESPACE}:availability_zones: give exactly two zone names, got {zones_given!r}")
    if cidrs is None or "0.0.0.0/0" in cidrs:
        raise ConfigError(f"{SETTINGS_NAMESPACE}:eks_public_access_cidrs: a list of CIDRs, never 0.0.0.0/0")
    capacity_wait = config.get_int("capacity_wait_minutes")
    if capacity_wait is not None and not 1 <= capacity_wait <= CAPACITY_WAIT_MAX_MINUTES:
        raise ConfigError(
            f"{SETTINGS_NAMESPACE}:capacity_wait_minutes: {capacity_wait} is not between 1 and "
            f"{CAPACITY_WAIT_MAX_MINUTES}: `pulumi up` waits for each GPU pool's instances, and never reports a pool "
            "without them as done"
        )
    node_image = config.get("node_image")
    image_problem = node_image_problem(node_image) if node_image is not None else None
    if image_problem is not None:
        raise ConfigError(f"{SETTINGS_NAMESPACE}:node_image: {image_problem}")
    ssm_agent = ssm_agent_pin(config.get("ssm_agent_version"), config.get("ssm_agent_sha256"))
    domain = config.get("dns_domain") or DNS_DOMAIN
    problem = dns_domain_problem(domain)
    if problem is not None:
        raise ConfigError(f"{SETTINGS_NAMESPACE}:dns_domain: {problem}")
    return InfraSettings(
        dns_domain=domain,
        kubernetes_version=config.get("kubernetes_version") or InfraSettings.kubernetes_version,
        availability_zones=zones,
        eks_public_access_cidrs=cidrs,
        lustre_capacity_gib=config.get_int("lustre_capacity_gib") or 0,
        ssh_key_name=config.get("ssh_key_name"),
        release=config.get("release") or InfraSettings.release,
        capacity_wait_minutes=capacity_wait or InfraSettings.capacity_wait_minutes,
        node_image=node_image,
        ssm_agent=ssm_agent,
        deploy_role_arn=pipeline_role_arn(config, "deploy_role_arn"),
        plan_role_arn=pipeline_role_arn(config, "plan_role_arn"),
        protect=protect_setting(config),
    )


def ssm_agent_pin(version: str | None, sha256: str | None) -> SsmAgentPin | None:
    """pdstack-infra:ssm_agent_version and ssm_agent_sha256 as node.json's pin: both or neither, each checked."""
    if version is None and sha256 is None:
        return None
    if version is None or sha256 is None:
        missing = "ssm_agent_version" if version is None else "ssm_agent_sha256"
        raise ConfigError(
            f"{SETTINGS_NAMESPACE}:{missing}: set with the other (ssm_agent_version and ssm_agent_sha256 pin the SSM "
            "agent's .deb together; docs/cloud.md says how to find both)"
        )
    try:
        return SsmAgentPin(version=version, sha256=sha256)
    except ValidationError as exc:
        field = str(exc.errors()[0]["loc"][0])
        raise ConfigError(
            f"{SETTINGS_NAMESPACE}:ssm_agent_{field}: {exc.errors()[0]['input']!r} is not "
            + ("a version like 3.3.1802.0" if field == "version" else "a sha256 (64 lowercase hex digits)")
        ) from None
