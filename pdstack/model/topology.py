"""Where things run: the environment, the datacenter a stack file describes, its node pools and its private links
to the other datacenters of the environment."""

from __future__ import annotations

import re
from enum import StrEnum
from ipaddress import IPv4Network

from pydantic import Field, model_validator

from pdstack.model.base import Name, Strict

AWS_REGION_PATTERN = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
LOCAL_REGION = "local"


class Environment(StrEnum):
    LOCAL = "local"
    DEV = "dev"
    STAGING = "staging"
    PROD = "prod"


class DatacenterRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    CONTROL = "control"
    MIXED = "mixed"


class PoolRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    CONTROL = "control"

    @property
    def needs_gpu(self) -> bool:
        return self is not PoolRole.CONTROL


class Placement(StrEnum):
    """EC2 placement strategy for a pool; `cluster` packs nodes in one AZ for EFA bandwidth."""

    NONE = "none"
    CLUSTER = "cluster"
    SPREAD = "spread"


class LinkKind(StrEnum):
    TRANSIT_GATEWAY = "transit_gateway"
    VPC_PEERING = "vpc_peering"
    EMULATED = "emulated"  # local only: the user-space WAN forwarder between node networks


class NodePool(Strict):
    name: Name
    role: PoolRole
    instance_type: str = Field(min_length=1)
    min_size: int = Field(ge=0, le=1000)
    desired_size: int = Field(ge=0, le=1000)
    max_size: int = Field(ge=1, le=1000)
    efa: bool = False
    placement: Placement = Placement.NONE
    data_volume_gib: int = Field(default=500, ge=0, le=65536)

    @model_validator(mode="after")
    def _sizes_ordered(self) -> NodePool:
        if not self.min_size <= self.desired_size <= self.max_size:
            raise ValueError(
                "need min_size <= desired_size <= max_size, "
                f"got {self.min_size} <= {self.desired_size} <= {self.max_size}"
            )
        return self


class Link(Strict):
    """A private link from this datacenter to a peer of the same environment."""

    peer: Name
    kind: LinkKind
    bandwidth_gbps: float = Field(gt=0, le=3200)
    rtt_ms: float = Field(ge=0, le=1000)
    loss_pct: float = Field(default=0.0, ge=0, lt=100)


class Datacenter(Strict):
    name: Name
    region: str = Field(description="AWS region, or `local` for the emulated datacenters")
    cidr: IPv4Network = Field(strict=False)
    role: DatacenterRole
    pools: list[NodePool] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Datacenter:
        if self.region != LOCAL_REGION and not AWS_REGION_PATTERN.match(self.region):
            raise ValueError(f"region {self.region!r} is neither `local` nor an AWS region like us-east-1")
        if not 16 <= self.cidr.prefixlen <= 24:
            raise ValueError(f"cidr {self.cidr} must be a /16 to /24 network to hold management and service subnets")
        if len({p.name for p in self.pools}) != len(self.pools):
            raise ValueError("pool names must be unique within a datacenter")
        if len({link.peer for link in self.links}) != len(self.links):
            raise ValueError("at most one link per peer datacenter")
        if any(link.peer == self.name for link in self.links):
            raise ValueError("a datacenter cannot link to itself")
        return self
