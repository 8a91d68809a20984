"""pdstack/local/pools.py and the topology it scales: a pool's desired capacity within the stack's bounds, nodes
beyond the stack's desired size launched from user data at addresses that never move another node."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdstack.local.inventory import inventory
from pdstack.local.pools import CapacityError, checked_capacity, load_capacity, save_capacity
from pdstack.local.topology import load_topology
from tests.support import STACKS


def test_a_pool_scaled_out_launches_its_extra_nodes_from_user_data_beside_the_converged_ones() -> None:
    before = load_topology(STACKS)
    after = load_topology(STACKS, {("dc2", "decode"): 3})
    assert [n for n in after.nodes if not n.launched] == list(before.nodes)
    (new,) = [n for n in after.nodes if n.launched]
    assert (new.name, str(new.address)) == ("dc2-decode-3", "10.210.2.100/24")
    assert new.name not in inventory(after)["all"]["children"]["nodes"]["hosts"]  # it converges itself


def test_a_pool_scaled_in_keeps_the_other_pools_addresses() -> None:
    before = load_topology(STACKS)
    after = load_topology(STACKS, {("dc2", "decode"): 1})
    assert [n.name for n in after.pool_nodes("dc2", "decode")] == ["dc2-decode-1"]
    assert {n.name: n.address for n in after.nodes} == {
        n.name: n.address for n in before.nodes if n.name != "dc2-decode-2"
    }


@pytest.mark.parametrize(
    ("dc", "pool", "desired", "field"),
    [
        ("dc9", "decode", 1, "datacenter"),
        ("dc2", "prefill", 1, "pool"),
        ("dc2", "decode", 4, "desired"),
        ("dc2", "decode", 0, "desired"),
        ("control", "control", 1, "pool"),
    ],
)
def test_a_capacity_the_pool_cannot_take_is_refused_naming_the_field(
    dc: str, pool: str, desired: int, field: str
) -> None:
    with pytest.raises(CapacityError, match=f"^{field}: "):
        checked_capacity(STACKS, dc, pool, desired)


def test_the_capacity_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "pools.json"
    assert load_capacity(path) == {}
    save_capacity(path, {("dc2", "decode"): checked_capacity(STACKS, "dc2", "decode", 3)})
    assert load_capacity(path) == {("dc2", "decode"): 3}
