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
from pdstack.local.inventory import PLATFORM_FILE, render_inventory, render_node_platform
from pdstack.local.topology import load_topology
from tests.support import REPO, STACKS

INVENTORY = REPO / "inventories" / "local" / "hosts.yml"


def test_committed_inventory_matches_the_stacks() -> None:
    assert INVENTORY.read_text() == render_inventory(load_topology(STACKS)), "run `pdstack local inventory`"


def test_committed_node_platform_matches_the_stacks() -> None:
    """What the node bundle carries for nodes booting from user data (playbooks/vars/platform/local.yml)."""
    assert (REPO / PLATFORM_FILE).read_text() == render_node_platform(load_topology(STACKS)), "run `pdstack local up`"


def test_ansible_groups_nodes_by_role_and_datacenter() -> None:
    bin_dir = Path(sys.executable).parent
    out = subprocess.run(
        [str(bin_dir / "ansible-inventory"), "-i", str(INVENTORY), "--list"], capture_output=True, text=True, check=True
    ).stdout
    groups = json.loads(out)
    assert groups["prefill"]["hosts"] == ["dc1-prefill-1", "dc1-prefill-2"]
    assert groups["decode"]["hosts"] == ["dc2-decode-1", "dc2-decode-2"]
    assert groups["control"]["hosts"] == ["control-control-1"]
    dc1 = groups["_meta"]["hostvars"]["dc1-prefill-1"]
    assert dc1["pdstack_address"] == "10.210.1.10"
    assert (dc1["kernel_tuning_link_bandwidth_gbps"], dc1["kernel_tuning_link_rtt_ms"]) == (1.0, 20.0)


def test_up_refuses_invalid_stacks_with_a_message_before_touching_the_machine(tmp_path: Path) -> None:
    (tmp_path / "Pulumi.yaml").write_text("name: pdstack\nruntime: python\n")
    shutil.copytree(REPO / "stacks", tmp_path / "stacks")
    control = tmp_path / "stacks" / "Pulumi.local-control.yaml"
    control.write_text(control.read_text().replace("cidr: 10.210.0.0/24", "cidr: 10.210.1.0/24"))
    result = CliRunner().invoke(app, ["local", "up", "--stacks", str(tmp_path / "stacks")])
    assert result.exit_code == 1
    assert "pdstack local up: environment local in" in result.output and "10.210.1.0/24" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # a message, not a traceback
