"""The same serving plays through inventories/local, where the control plane is an inventory host: every server and
the controller call the scheduler on the first control node, the weights calls are delegated to it, and the canary
judge queries the Prometheus on it (the cloud counterpart is in test_aws_inventory.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from tests.inventories.scheduler_calls import BIN, scheduler_calls
from tests.support import REPO

INVENTORY = REPO / "inventories" / "local" / "hosts.yml"


def test_local_plays_reach_the_scheduler_and_prometheus_on_the_first_control_node(tmp_path: Path) -> None:
    listed = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(INVENTORY), "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    first = json.loads(listed.stdout)["control"]["hosts"][0]
    rendered = yaml.safe_load((REPO / "playbooks" / "vars" / "contract" / "local.yml").read_text())
    port = rendered["pdserve_components"]["scheduler"]["port"]
    assert "pdstack_prometheus_url_parameter" not in rendered  # no SSM locally
    address = "'address': hostvars[groups['control'][0]]['pdstack_address']"
    seen = scheduler_calls(tmp_path, INVENTORY, also=address)
    assert "localhost" in seen and len(seen) > 2
    for name, got in seen.items():
        assert got["scheduler_url"] == f"http://{got['address']}:{port}", name
        assert got["weights_host"] == first, name  # the admin token goes to the control node only
        assert got["prometheus_url"] == f"http://{got['address']}:{rendered['prometheus_port']}", name
