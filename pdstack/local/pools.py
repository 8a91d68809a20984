"""The local pools' Auto Scaling groups: each GPU pool's desired capacity, as `pdstack local scale` sets it.

In the cloud a pool's group holds the desired capacity and launches or drains instances to reach it; here the same
number lives in the environment's state folder (pools.json), within the stack's min_size and max_size, and the
topology (pdstack.local.topology) derives the nodes from it: the stack's desired_size nodes are the ones the
operators' playbooks converge, those beyond it boot from the pool's user data.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdstack.local.topology import Capacity
from pdstack.model import Environment, PoolRole
from pdstack.stacks.environment import load_environment


class CapacityError(ValueError):
    """A desired capacity the pool cannot take (no such GPU pool, or outside its min and max)."""


def load_capacity(path: Path) -> Capacity:
    if not path.is_file():
        return {}
    entries = json.loads(path.read_text())
    return {(e["datacenter"], e["pool"]): int(e["desired"]) for e in entries}


def save_capacity(path: Path, capacity: Capacity) -> None:
    entries = [{"datacenter": dc, "pool": pool, "desired": n} for (dc, pool), n in sorted(capacity.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=2) + "\n")


def checked_capacity(stacks_dir: Path, datacenter: str, pool: str, desired: int) -> int:
    """`desired` if the local stacks' GPU pool `pool` of `datacenter` takes it, else CapacityError naming why."""
    local = load_environment(stacks_dir, Environment.LOCAL)
    dcs = {s.config.datacenter.name: s.config.datacenter for s in local.stacks}
    if datacenter not in dcs:
        raise CapacityError(f"datacenter: no local datacenter {datacenter!r} (there are: {', '.join(sorted(dcs))})")
    pools = {p.name: p for p in dcs[datacenter].pools if p.role is not PoolRole.CONTROL}
    if pool not in pools:
        raise CapacityError(
            f"pool: {datacenter} has no GPU pool {pool!r} (it has: {', '.join(sorted(pools)) or 'none'})"
        )
    spec = pools[pool]
    if not spec.min_size <= desired <= spec.max_size:
        raise CapacityError(
            f"desired: {datacenter}/{pool} takes {spec.min_size} to {spec.max_size} nodes (the stack's min_size and "
            f"max_size), not {desired}"
        )
    return desired
