"""Two real node containers serving pdserve through playbooks/serving.yml, with images pulled from a real registry.

Node A is the control plane and a prefill node (scheduler, gateway, prefill); node B is a decode node. The session
builds nothing it can reuse (node image, runtime image), starts Debian's docker-registry on the podman bridge,
pushes the runtime image there, installs podman in the nodes with the container_runtime role, and converges
release r1. Tests then upgrade, roll back, corrupt the model and kill containers on this cluster, in file order.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdstack import nodes
from pdstack.contract import Component, contract, environment_serving
from pdstack.local.inventory import NESTED_NODE_VARS
from pdstack.local.model import MODEL_NAME, ensure_model
from pdstack.local.registry import Registry
from pdstack.local.secrets import LocalSecrets
from tests.serving.server.serverproc import free_port

REPO = Path(__file__).resolve().parents[2]
# The ports the playbooks deploy with: the local environment's contract (playbooks/vars/contract/local.yml).
CONTRACT = contract(environment_serving(REPO / "stacks", "local"))
ANSIBLE_PLAYBOOK = str(REPO / ".venv" / "bin" / "ansible-playbook")
RUNTIME_IMAGE = os.environ.get("PDSTACK_TEST_RUNTIME_IMAGE", "localhost/pdserve:latest")
NODE_A, NODE_B = f"pdstack-serve-a-{os.getpid()}", f"pdstack-serve-b-{os.getpid()}"  # unique per test process
LONG_PROMPT = "Prefill runs in one datacenter and decode in another; " * 4  # past the offload threshold

# Node containers on this host need what the local environment's nodes need (nested podman, see DESIGN.md).
NODE_VARS: dict[str, Any] = {
    **NESTED_NODE_VARS,
    "ansible_connection": "containers.podman.podman",
    "ansible_python_interpreter": "/usr/bin/python3",
    "ansible_become": False,  # the podman connection is root already; the nodes have no sudo
    "pdstack_environment": "local",
    # Prompts of 8+ tokens take the prefill -> KV channel -> decode path (the local stack uses 32).
    "pdserve_env": {"PDSERVE_OFFLOAD_THRESHOLD_TOKENS": "8"},
}
RUNTIME_PLAY = [{"name": "Container runtime", "hosts": "all", "gather_facts": True, "roles": ["container_runtime"]}]


@dataclass
class Played:
    returncode: int
    output: str

    def changed(self) -> int:
        return sum(
            int(line.split("changed=")[1].split()[0])
            for line in self.output.splitlines()
            if " changed=" in line and " ok=" in line
        )


@dataclass
class Serving:
    workdir: Path
    inventory: Path
    registry: Registry
    image: str
    model_source: Path
    secrets: LocalSecrets
    address: dict[str, str]

    def release_vars(self, version: str, config_version: str = "1", **extra: Any) -> Path:
        path = self.workdir / f"release-{version}-{config_version}.json"
        path.write_text(json.dumps({
            "pdstack_release": {"version": version, "image": self.image, "config_version": config_version},
            "pdstack_model": {"name": MODEL_NAME, "source": str(self.model_source)},
            "pdstack_secrets_dir": str(self.secrets.folder),
            **extra,
        }))  # fmt: skip
        return path

    def play(self, playbook: str, *args: str) -> Played:
        return run_playbook(self.inventory, REPO / "playbooks" / playbook, self.workdir, *args)

    def node(self, name: str, *command: str) -> str:
        return nodes.exec_in_node(name, list(command))

    def record(self, name: str, component: str) -> dict[str, Any]:
        text = self.node(name, "cat", f"/var/lib/pdstack/pdserve/{component}.release.json")
        record: dict[str, Any] = json.loads(text)
        return record

    def gateway(self) -> str:
        return f"http://{self.address[NODE_A]}:{CONTRACT[Component.GATEWAY].port}"

    def scheduler(self) -> str:
        return f"http://{self.address[NODE_A]}:{CONTRACT[Component.SCHEDULER].port}"

    def complete(self, prompt: str = LONG_PROMPT, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(
            f"{self.gateway()}/v1/completions",
            timeout=60,
            headers={"Authorization": f"Bearer {self.secrets.api_key.read_text().strip()}"},
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )


def run_playbook(inventory: Path, playbook: Path, home: Path, *args: str) -> Played:
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(inventory), str(playbook), *args],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={"PATH": f"{REPO / '.venv' / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
             "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "HOME": str(home)},
    )  # fmt: skip
    return Played(result.returncode, result.stdout + result.stderr)


def bridge_gateway() -> str:
    info = json.loads(
        subprocess.run(["podman", "network", "inspect", "podman"], capture_output=True, text=True, check=True).stdout
    )
    return str(info[0]["subnets"][0]["gateway"])


def write_inventory(workdir: Path, registry: str, address: dict[str, str]) -> Path:
    host_vars = {name: {"ansible_host": name, "pdstack_address": address[name]} for name in (NODE_A, NODE_B)}
    inventory = {"all": {
        "vars": {**NODE_VARS, "pdstack_registry": registry,
                 "container_runtime_registries": [{"location": registry, "insecure": True}]},
        "children": {
            "nodes": {"hosts": host_vars},
            "control": {"hosts": {NODE_A: None}},
            "prefill": {"hosts": {NODE_A: None}},
            "decode": {"hosts": {NODE_B: None}},
        },
    }}  # fmt: skip
    path = workdir / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


@pytest.fixture(scope="module")  # torn down after its module: its servers would load the rest of the run
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    workdir = tmp_path_factory.mktemp("serving")
    nodes.build_node_image()
    if not nodes.image_exists(RUNTIME_IMAGE):
        subprocess.run(["bash", str(REPO / "serving" / "build-image.sh"), RUNTIME_IMAGE], check=True)
    registry = Registry(workdir / "registry", address=bridge_gateway(), port=free_port())
    registry.state_dir.mkdir()
    started: list[str] = []
    try:
        for name in (NODE_A, NODE_B):
            started.append(nodes.create_node(nodes.NodeSpec(name)))
        registry.start()
        image = registry.push(RUNTIME_IMAGE, "pdstack/pdserve", "test")
        address = {name: nodes.node_address(name) for name in (NODE_A, NODE_B)}
        inventory = write_inventory(workdir, registry.endpoint, address)
        secrets = LocalSecrets(workdir / "secrets")
        secrets.ensure()
        (workdir / "runtime.yml").write_text(yaml.safe_dump(RUNTIME_PLAY))
        runtime = run_playbook(inventory, workdir / "runtime.yml", workdir)
        assert runtime.returncode == 0, runtime.output[-4000:]
        yield Serving(workdir, inventory, registry, image, ensure_model(workdir / "models"), secrets, address)
    finally:
        for name in started:
            nodes.remove_node(name)
        registry.stop()
