"""The committed local inventory is exactly what the local stacks render to, and Ansible reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdstack.local.inventory import render_inventory
from pdstack.local.topology import load_topology
from tests.conftest import REPO, STACKS

INVENTORY = REPO / "inventories" / "local" / "hosts.yml"


def test_committed_inventory_matches_the_stacks() -> None:
    assert INVENTORY.read_text() == render_inventory(load_topology(STACKS)), "run `pdstack local inventory`"


def test_ansible_groups_nodes_by_role_and_datacenter() -> None:
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / "ansible-inventory"), "-i", str(INVENTORY), "--list"],
                         capture_output=True, text=True, check=True).stdout
    groups = json.loads(out)
    assert groups["prefill"]["hosts"] == ["dc1-prefill-1", "dc1-prefill-2"]
    assert groups["decode"]["hosts"] == ["dc2-decode-1", "dc2-decode-2"]
    assert groups["control"]["hosts"] == ["control-control-1"]
    dc1 = groups["_meta"]["hostvars"]["dc1-prefill-1"]
    assert dc1["pdstack_address"] == "10.210.1.10"
    assert (dc1["kernel_tuning_link_bandwidth_gbps"], dc1["kernel_tuning_link_rtt_ms"]) == (1.0, 20.0)
