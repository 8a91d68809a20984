"""The same serving plays through inventories/local, where the control plane is an inventory host: every server and
the controller call the scheduler on the first control node, the weights calls are delegated to it, and the canary
judge queries the Prometheus on it (the cloud counterpart is in test_aws_inventory.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support import REPO

BIN = Path(sys.executable).parent
INVENTORY = REPO / "inventories" / "local" / "hosts.yml"


def test_local_plays_reach_the_scheduler_and_prometheus_on_the_first_control_node(tmp_path: Path) -> None:
    listed = subprocess.run([str(BIN / "ansible-inventory"), "-i", str(INVENTORY), "--list"], cwd=REPO,
                            capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    first = json.loads(listed.stdout)["control"]["hosts"][0]
    rendered = yaml.safe_load((REPO / "playbooks" / "vars" / "contract" / "local.yml").read_text())
    port = rendered["pdserve_components"]["scheduler"]["port"]
    assert "pdstack_prometheus_url_parameter" not in rendered  # no SSM locally
    play_dir = tmp_path / "play"  # beside playbooks/vars, as the playbooks are
    play_dir.mkdir()
    (play_dir / "vars").symlink_to(REPO / "playbooks" / "vars")
    (play_dir / "probe.yml").write_text(yaml.safe_dump([
        {"name": "Where each party calls the scheduler", "hosts": "prefill:decode:localhost", "gather_facts": False,
         "vars_files": [str(REPO / "roles" / "pdserve" / "defaults" / "main.yml"), "vars/serving.yml"],
         "tasks": [{"name": "Write it on the controller", "delegate_to": "localhost", "ansible.builtin.copy": {
             "content": "{{ {'scheduler_url': pdserve_scheduler_url, 'weights_host': pdserve_weights_host,"
                        " 'prometheus_url': pdstack_prometheus_url,"
                        " 'address': hostvars[groups['control'][0]]['pdstack_address']} | to_json }}",
             "dest": f"{tmp_path}/{{{{ inventory_hostname }}}}.json", "mode": "0600"}}]},
    ]))  # fmt: skip
    probe = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(INVENTORY), str(play_dir / "probe.yml")],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stdout[-4000:] + probe.stderr[-2000:]
    seen = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert "localhost" in seen and len(seen) > 2
    for name, got in seen.items():
        assert got["scheduler_url"] == f"http://{got['address']}:{port}", name
        assert got["weights_host"] == first, name  # the admin token goes to the control node only
        assert got["prometheus_url"] == f"http://{got['address']}:{rendered['prometheus_port']}", name
