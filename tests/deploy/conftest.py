"""Two real node containers serving pdserve through playbooks/serving.yml, with images pulled from a real registry.

Node A is the control plane and a prefill node (scheduler, gateway, prefill); node B is a decode node. The session
builds nothing it can reuse (node image, runtime image), starts Debian's docker-registry on the podman bridge,
pushes the runtime and Prometheus images there, and installs podman in the nodes (reached over SSH) with the
container_runtime role. test_serving_role.py converges release r1 once, then upgrades, rolls back, corrupts the model
and kills containers on this cluster, in file order.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdstack.contract.components import Component, contract
from pdstack.contract.files import environment_serving
from pdstack.local import nodes
from pdstack.local.images import build_prometheus_image, build_runtime_image
from pdstack.local.inventory import NESTED_NODE_VARS
from pdstack.local.model import MODEL_NAME, ensure_model
from pdstack.local.registry import Registry
from pdstack.local.secrets import LocalSecrets
from pdstack.local.tls import Leaf, LocalCA
from pdstack.local.transport import OPERATOR
from tests.support import REPO
from tests.support.ansible import ANSIBLE_PLAYBOOK, PlaybookRun
from tests.support.ports import free_port

# The ports the playbooks deploy with: the local environment's contract (playbooks/vars/contract/local.yml).
CONTRACT = contract(environment_serving(REPO / "stacks", "local"))
# The runtime image of this checkout's serving/ (tagged by its sources' hash, built unless present): a `latest`
# left by an earlier run of other sources would deploy old code.
RUNTIME_IMAGE = os.environ.get("PDSTACK_TEST_RUNTIME_IMAGE")
NODE_A, NODE_B = f"pdstack-serve-a-{os.getpid()}", f"pdstack-serve-b-{os.getpid()}"  # unique per test process
LONG_PROMPT = "Prefill runs in one datacenter and decode in another; " * 4  # past the offload threshold

# Node containers on this host need what the local environment's nodes need (nested podman, see DESIGN.md).
# Ansible reaches them over SSH with pipelining, as it reaches real nodes: one round trip per task, where the podman
# connection ran a `podman exec` to make a temporary folder, a `podman cp` and another exec for each task.
NODE_VARS: dict[str, Any] = {
    **NESTED_NODE_VARS,
    "ansible_user": "root",
    "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
    "ansible_ssh_pipelining": True,
    "ansible_python_interpreter": "/usr/bin/python3",
    "ansible_become": False,  # root already; the nodes have no sudo
    "pdstack_environment": "local",
    # Prompts of 8+ tokens take the prefill -> KV channel -> decode path (the local stack uses 32).
    "pdserve_env": {"PDSERVE_OFFLOAD_THRESHOLD_TOKENS": "8"},
}
RUNTIME_PLAY = [{"name": "Container runtime", "hosts": "all", "gather_facts": True, "roles": ["container_runtime"]}]


@dataclass
class Serving:
    workdir: Path
    inventory: Path
    registry: Registry
    image: str
    prometheus_image: str
    model_source: Path
    secrets: LocalSecrets
    address: dict[str, str]
    tls: LocalCA

    def release_vars(self, version: str, config_version: str = "1", **extra: Any) -> Path:
        path = self.workdir / f"release-{version}-{config_version}.json"
        path.write_text(
            json.dumps(
                {
                    "pdstack_release": {"version": version, "image": self.image, "config_version": config_version},
                    "pdstack_prometheus_image": self.prometheus_image,
                    "pdstack_model": {"name": MODEL_NAME, "source": str(self.model_source)},
                    "pdstack_secrets_dir": str(self.secrets.folder),
                    "pdstack_tls_dir": str(self.tls.folder),
                    **extra,
                }
            )
        )
        return path

    def play(self, playbook: str, *args: str) -> PlaybookRun:
        return run_playbook(self.inventory, REPO / "playbooks" / playbook, self.workdir, *args)

    def node(self, name: str, *command: str) -> str:
        return nodes.exec_in_node(name, list(command))

    def record(self, name: str, component: str) -> dict[str, Any]:
        text = self.node(name, "cat", f"/var/lib/pdstack/pdserve/{component}.release.json")
        record: dict[str, Any] = json.loads(text)
        return record

    def gateway(self) -> str:
        return f"https://{self.address[NODE_A]}:{CONTRACT[Component.GATEWAY].port}"

    def gateway_metrics(self) -> str:
        """The gateway's /metrics, presenting its metrics token as Prometheus does (without it: 401)."""
        token = self.secrets.metrics_scrape_token.read_text().strip()
        response = httpx.get(f"{self.gateway()}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert response.status_code == 200, response.text
        return response.text

    def scheduler(self) -> str:
        return f"https://{self.address[NODE_A]}:{CONTRACT[Component.SCHEDULER].port}"

    @cached_property
    def internal(self) -> httpx.Client:
        """A client of the scheduler's and the servers' APIs: under the local stack's mutual TLS they admit only a
        caller with a certificate from the CA, here the operator's (pdstack.local.transport.OPERATOR)."""
        context = ssl.create_default_context(cafile=str(self.tls.ca_cert))
        context.load_cert_chain(self.tls.cert(OPERATOR.name), self.tls.key(OPERATOR.name))
        return httpx.Client(verify=context)

    def complete(self, prompt: str = LONG_PROMPT, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(
            f"{self.gateway()}/v1/completions",
            timeout=60,
            headers={"Authorization": f"Bearer {self.secrets.api_key.read_text().strip()}"},
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )


def run_playbook(inventory: Path, playbook: Path, home: Path, *args: str) -> PlaybookRun:
    started = time.monotonic()
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(inventory), str(playbook), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={
            "PATH": f"{REPO / '.venv' / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "HOME": str(home),
        },
    )
    with (home / "plays.log").open("a") as log:  # where the module's time goes (docs/testing.md)
        log.write(f"{time.monotonic() - started:7.1f} s  {playbook.name} {' '.join(args)}\n")
    return PlaybookRun(result.returncode, result.stdout + result.stderr)


def bridge_gateway() -> str:
    info = json.loads(
        subprocess.run(["podman", "network", "inspect", "podman"], capture_output=True, text=True, check=True).stdout
    )
    return str(info[0]["subnets"][0]["gateway"])


def write_inventory(workdir: Path, registry: str, address: dict[str, str], key: Path) -> Path:
    host_vars = {name: {"ansible_host": address[name], "pdstack_address": address[name]} for name in (NODE_A, NODE_B)}
    inventory = {
        "all": {
            "vars": {
                **NODE_VARS,
                "ansible_ssh_private_key_file": str(key),
                "pdstack_registry": registry,
                "container_runtime_registries": [{"location": registry, "insecure": True}],
            },
            "children": {
                "nodes": {"hosts": host_vars},
                "control": {"hosts": {NODE_A: None}},
                "prefill": {"hosts": {NODE_A: None}},
                "decode": {"hosts": {NODE_B: None}},
            },
        }
    }
    path = workdir / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


@pytest.fixture(scope="module")  # torn down after its module: its servers would load the rest of the run
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    workdir = tmp_path_factory.mktemp("serving")
    nodes.build_node_image()
    runtime_image = RUNTIME_IMAGE or build_runtime_image(REPO)
    registry = Registry(workdir / "registry", address=bridge_gateway(), port=free_port())
    registry.state_dir.mkdir()
    key = nodes.ensure_ssh_key(workdir / "ssh" / "id_ed25519")
    both = ThreadPoolExecutor(max_workers=2)  # the nodes boot, and are removed, side by side
    monkeypatch = pytest.MonkeyPatch()
    try:
        for name in both.map(lambda name: nodes.create_node(nodes.NodeSpec(name)), (NODE_A, NODE_B)):
            nodes.authorize_ssh_key(name, key.with_suffix(".pub").read_text())
        registry.start()
        image = registry.push(runtime_image, "pdstack/pdserve", "test")
        prometheus = registry.push(build_prometheus_image(REPO), "pdstack/prometheus", "test")
        address = {name: nodes.node_address(name) for name in (NODE_A, NODE_B)}
        inventory = write_inventory(workdir, registry.endpoint, address, key)
        secrets = LocalSecrets(workdir / "secrets")
        secrets.ensure()
        # Served over TLS as `pdstack local up` serves it: a CA of the test's own and a certificate per node by
        # address; every client here (httpx reads SSL_CERT_FILE) verifies it.
        tls = LocalCA(workdir / "tls")
        tls.ensure([*(Leaf(name, (name,), (address[name],)) for name in (NODE_A, NODE_B)), OPERATOR])
        monkeypatch.setenv("SSL_CERT_FILE", str(tls.ca_cert))
        (workdir / "runtime.yml").write_text(yaml.safe_dump(RUNTIME_PLAY))
        runtime = run_playbook(inventory, workdir / "runtime.yml", workdir)
        assert runtime.returncode == 0, runtime.output[-4000:]
        yield Serving(
            workdir, inventory, registry, image, prometheus, ensure_model(workdir / "models"), secrets, address, tls
        )
    finally:
        monkeypatch.undo()
        list(both.map(nodes.remove_node, (NODE_A, NODE_B)))  # names unique to this process: none is another's
        both.shutdown()
        registry.stop()
