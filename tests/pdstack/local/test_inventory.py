"""The committed local inventory is exactly what the local stacks render to, and Ansible reads it; `up` refuses
invalid stacks before it touches the machine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.local.inventory import PLATFORM_FILE, render_inventory, render_node_platform, write_inventory
from pdstack.local.topology import load_topology
from tests.support import REPO, STACKS

INVENTORY = REPO / "inventories" / "local" / "hosts.yml"
ANSIBLE_INVENTORY = str(Path(sys.executable).parent / "ansible-inventory")


def test_committed_inventory_matches_the_stacks() -> None:
    assert INVENTORY.read_text() == render_inventory(load_topology(STACKS)), "run `pdstack local inventory`"


def test_committed_node_platform_matches_the_stacks() -> None:
    """What the node bundle carries for nodes booting from user data (playbooks/vars/platform/local.yml)."""
    assert (REPO / PLATFORM_FILE).read_text() == render_node_platform(load_topology(STACKS)), "run `pdstack local up`"


def test_ansible_groups_nodes_by_role_and_datacenter() -> None:
    out = subprocess.run(
        [ANSIBLE_INVENTORY, "-i", str(INVENTORY), "--list"], capture_output=True, text=True, check=True
    ).stdout
    groups = json.loads(out)
    assert groups["prefill"]["hosts"] == ["dc1-prefill-1", "dc1-prefill-2"]
    assert groups["decode"]["hosts"] == ["dc2-decode-1", "dc2-decode-2"]
    assert groups["control"]["hosts"] == ["control-control-1"]
    dc1 = groups["_meta"]["hostvars"]["dc1-prefill-1"]
    assert dc1["pdstack_address"] == "10.210.1.10"
    assert (dc1["kernel_tuning_link_bandwidth_gbps"], dc1["kernel_tuning_link_rtt_ms"]) == (1.0, 20.0)


def test_nodes_a_group_launched_are_listed_beside_the_stacks_own(tmp_path: Path) -> None:
    """The operators' plays (`-i inventories/local`: deploy.yml's canary, rollback.yml) reach the nodes `pdstack
    local scale` launched, with their groups' variables, as the aws_ec2 inventory lists an Auto Scaling group's
    instances; the committed hosts.yml keeps the stack's own, and the launched file goes with the last of them."""
    scaled = load_topology(STACKS, {("dc2", "decode"): 3})
    folder = tmp_path / "local"
    assert write_inventory(scaled, folder)
    assert (folder / "hosts.yml").read_text() == INVENTORY.read_text()
    listed = json.loads(
        subprocess.run(
            [ANSIBLE_INVENTORY, "-i", str(folder), "--list"], capture_output=True, text=True, check=True
        ).stdout
    )
    assert listed["decode"]["hosts"] == ["dc2-decode-1", "dc2-decode-2", "dc2-decode-3"]
    assert "dc2-decode-3" in listed["dc_dc2"]["hosts"]
    launched, beside = listed["_meta"]["hostvars"]["dc2-decode-3"], listed["_meta"]["hostvars"]["dc2-decode-1"]
    assert (launched["pdstack_address"], launched["pdstack_pool"], launched["ansible_user"]) == (
        "10.210.2.100",
        "decode",
        "root",
    )
    assert launched["kernel_tuning_link_rtt_ms"] == beside["kernel_tuning_link_rtt_ms"]  # its datacenter's links
    assert write_inventory(load_topology(STACKS), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["hosts.yml"]


def test_up_refuses_invalid_stacks_with_a_message_before_touching_the_machine(tmp_path: Path) -> None:
    (tmp_path / "Pulumi.yaml").write_text("name: pdstack\nruntime: python\n")
    shutil.copytree(REPO / "stacks", tmp_path / "stacks")
    control = tmp_path / "stacks" / "Pulumi.local-control.yaml"
    control.write_text(control.read_text().replace("cidr: 10.210.0.0/24", "cidr: 10.210.1.0/24"))
    result = CliRunner().invoke(app, ["local", "up", "--stacks", str(tmp_path / "stacks")])
    assert result.exit_code == 1
    assert "pdstack local up: environment local in" in result.output and "10.210.1.0/24" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # a message, not a traceback
