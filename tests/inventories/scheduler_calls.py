"""Where each party of an inventory calls the scheduler, the weights admin and Prometheus, as the serving roles
template it: a probe play run beside playbooks/vars (as the playbooks are) writes each host's view on the controller."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.support import REPO

BIN = Path(sys.executable).parent
VIEW = (
    "'scheduler_url': pdserve_scheduler_url, 'weights_host': pdserve_weights_host,"
    " 'prometheus_url': pdstack_prometheus_url"
)


def scheduler_calls(
    folder: Path, inventory: Path, *args: str, also: str = "", env: Mapping[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Each host's (and the controller's: localhost) URLs by host name; `also`: more `'key': expression` pairs."""
    play_dir = folder / "play"
    play_dir.mkdir()
    (play_dir / "vars").symlink_to(REPO / "playbooks" / "vars")
    (play_dir / "probe.yml").write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Where each party calls the scheduler",
                    "hosts": "prefill:decode:localhost",
                    "gather_facts": False,
                    "vars_files": [str(REPO / "roles" / "pdserve" / "defaults" / "main.yml"), "vars/serving.yml"],
                    "tasks": [
                        {
                            "name": "Write it on the controller",
                            "delegate_to": "localhost",
                            "ansible.builtin.copy": {
                                "content": f"{{{{ {{{VIEW}{', ' + also if also else ''}}} | to_json }}}}",
                                "dest": f"{folder}/{{{{ inventory_hostname }}}}.json",
                                "mode": "0600",
                            },
                        }
                    ],
                },
            ]
        )
    )
    probe = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), str(play_dir / "probe.yml"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stdout[-4000:] + probe.stderr[-2000:]
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
