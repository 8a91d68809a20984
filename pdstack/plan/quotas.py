"""What an environment's own infrastructure needs of an AWS account's service quotas, per region: what `pulumi up`
of its stacks creates (infra/program.py), beside the quotas' defaults, so an operator asks for increases before the
first `up` fails half-way. Dev, staging and prod in one account add up: their needs are summed per region.

Per stack (datacenter): one VPC, one Transit Gateway (infra/links.py's hub, on every stack), and a NAT gateway with
its Elastic IP per availability zone (two zones), one only in dev (infra/network.py). Per instance family: the vCPUs of
every pool at its max_size (Auto Scaling may reach it), counted in the family's On-Demand vCPU quota."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.table import Table

from pdstack.model import Environment
from pdstack.plan.catalog import Catalog, load_catalog
from pdstack.stacks.files import StackFile

AZ_COUNT = 2  # infra/network.py's


@dataclass(frozen=True)
class Quota:
    name: str
    code: str  # Service Quotas' code (service ec2 or vpc)
    default: int | None  # None: set per account by AWS (P instances often start at 0)


VPCS = Quota("VPCs per region", "vpc/L-F678F1CE", 5)
EIPS = Quota("Elastic IP addresses", "ec2/L-0263D0A3", 5)
NAT_PER_AZ = Quota("NAT gateways per availability zone", "vpc/L-FE5A380F", 5)
TRANSIT_GATEWAYS = Quota("Transit gateways per region", "ec2/L-A2478D36", 5)
# On-Demand vCPU quotas by instance family (the leading letters of the instance type).
FAMILY_QUOTAS: dict[str, Quota] = {
    "p": Quota("Running On-Demand P instances (vCPUs)", "ec2/L-417A185B", None),
    "g": Quota("Running On-Demand G and VT instances (vCPUs)", "ec2/L-DB2E81BA", None),
    "vt": Quota("Running On-Demand G and VT instances (vCPUs)", "ec2/L-DB2E81BA", None),
    "dl": Quota("Running On-Demand DL instances (vCPUs)", "ec2/L-6E869C2A", None),
    "trn": Quota("Running On-Demand Trn instances (vCPUs)", "ec2/L-2C3B7624", None),
    "inf": Quota("Running On-Demand Inf instances (vCPUs)", "ec2/L-1945791B", None),
}
STANDARD = Quota("Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances (vCPUs)", "ec2/L-1216C47A", None)


def family_quota(instance_type: str) -> Quota:
    """The On-Demand vCPU quota an instance type counts in (p5.48xlarge: P; g6e.xlarge: G and VT; m7i: Standard)."""
    letters = re.match(r"[a-z]+", instance_type)
    return FAMILY_QUOTAS.get(letters.group(0) if letters else "", STANDARD)


@dataclass
class QuotaNeed:
    region: str
    quota: Quota
    needed: int
    why: list[str] = field(default_factory=list)

    @property
    def over_default(self) -> bool:
        return self.quota.default is not None and self.needed > self.quota.default

    def as_json(self) -> dict[str, object]:
        return {
            "region": self.region,
            "quota": self.quota.name,
            "code": self.quota.code,
            "default": self.quota.default,
            "needed": self.needed,
            "over_default": self.over_default,
            "why": self.why,
        }


def quota_needs(stacks: Iterable[StackFile], catalog: Catalog | None = None) -> list[QuotaNeed]:
    """Per region and quota, what the stacks' `pulumi up` needs (local stacks, not deployed by Pulumi, aside)."""
    catalog = catalog or load_catalog()
    needs: dict[tuple[str, str], QuotaNeed] = {}

    def add(region: str, quota: Quota, amount: int, why: str) -> None:
        need = needs.setdefault((region, quota.name), QuotaNeed(region, quota, 0))
        need.needed += amount
        need.why.append(why)

    per_az: dict[str, int] = {}
    for stack in stacks:
        cfg = stack.config
        if cfg.environment is Environment.LOCAL:
            continue
        region, name = cfg.datacenter.region, f"{cfg.environment}-{cfg.datacenter.name}"
        nats = 1 if cfg.environment is Environment.DEV else AZ_COUNT
        add(region, VPCS, 1, name)
        add(region, TRANSIT_GATEWAYS, 1, name)
        add(region, EIPS, nats, f"{name}: {nats} NAT")
        per_az[region] = per_az.get(region, 0) + 1  # at most one NAT gateway per zone and stack
        for pool in cfg.datacenter.pools:
            instance = catalog.instance(pool.instance_type)
            if instance is None:
                continue
            vcpus = instance.vcpu * pool.max_size
            add(
                region,
                family_quota(pool.instance_type),
                vcpus,
                f"{name}/{pool.name}: {pool.max_size} x {pool.instance_type} ({instance.vcpu} vCPUs)",
            )
    for region, count in per_az.items():
        needs[(region, NAT_PER_AZ.name)] = QuotaNeed(region, NAT_PER_AZ, count, [f"{count} stack(s) in the region"])
    return sorted(needs.values(), key=lambda n: (n.region, n.quota.name))


def render_quotas(needs: list[QuotaNeed]) -> Table:
    table = Table(
        title="Service quotas this environment's stacks need (per region; environments in one account add up)"
    )
    for column in ("region", "quota", "code", "needed", "default", "for"):
        table.add_column(column, overflow="fold")
    for need in needs:
        default = "per account" if need.quota.default is None else str(need.quota.default)
        needed = f"[bold red]{need.needed}[/]" if need.over_default else str(need.needed)
        table.add_row(need.region, need.quota.name, need.quota.code, needed, default, "; ".join(need.why))
    return table
