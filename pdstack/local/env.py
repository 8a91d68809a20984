"""`pdstack local up | down | status`: all of pdstack on one machine, from the `local` stacks.

`up` validates the stacks, builds the networks and the emulated WAN, starts the registry, builds and pushes the images,
creates the node containers, runs `playbooks/site.yml` against them, and sends one completion through the gateway.
Every step is idempotent; `down` removes every container, namespace, link and rule that `up` made.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai import OpenAI

from pdstack import nodes
from pdstack.contract import Component, ansible_vars, contract, write_ansible_vars
from pdstack.local.images import Images, build_and_push
from pdstack.local.inventory import write_inventory
from pdstack.local.model import ensure_model
from pdstack.local.network import LocalNetwork
from pdstack.local.registry import Registry
from pdstack.local.secrets import LocalSecrets
from pdstack.local.topology import Node, Topology, load_topology
from pdstack.model import PoolRole

# One user on one machine: the local tenant's rate limits stay out of the way of load tests and benchmarks.
LOCAL_RATE_LIMITS = {
    "PDSERVE_REQUESTS_PER_SECOND": "10000",
    "PDSERVE_REQUEST_BURST": "10000",
    "PDSERVE_TOKENS_PER_MINUTE": "100000000",
}


class PlaybookError(RuntimeError):
    pass


@dataclass(frozen=True)
class LocalEnv:
    project: Path

    @property
    def stacks_dir(self) -> Path:
        return self.project / "stacks"

    @property
    def state_dir(self) -> Path:
        return self.project / ".cache" / "local"

    @property
    def inventory(self) -> Path:
        return self.project / "inventories" / "local" / "hosts.yml"

    @property
    def ssh_key(self) -> Path:
        return self.state_dir / "ssh" / "id_ed25519"

    @property
    def release_file(self) -> Path:
        """The extra vars of the release `up` deploys (images by digest, model, secrets folder, settings)."""
        return self.state_dir / "release.json"

    @property
    def secrets(self) -> LocalSecrets:
        return LocalSecrets(self.state_dir / "secrets")

    def topology(self) -> Topology:
        return load_topology(self.stacks_dir)

    def network(self, topology: Topology) -> LocalNetwork:
        return LocalNetwork(topology, self.state_dir / "network")

    def registry(self) -> Registry:
        return Registry(self.state_dir)

    # -- up / down ------------------------------------------------------------------------------------------------

    def up(self, say: Callable[[str], None] = print) -> dict[str, Any]:
        topology = self.topology()
        self.secrets.ensure()
        say("network: router and node namespaces, emulated WAN links")
        self.network(topology).up()
        say("registry: starting")
        registry = self.registry()
        registry.start()
        say("images: node, runtime and Prometheus images (built when their sources changed), pushed to the registry")
        nodes.build_node_image()
        images = build_and_push(self.project, registry)
        say("model: the seeded test checkpoint and its SHA256SUMS manifest")
        model = ensure_model(self.state_dir / "models", topology.serving.model.name)
        say("nodes: starting node containers in their datacenter namespaces")
        key = nodes.ensure_ssh_key(self.ssh_key)
        for node in topology.nodes:
            ensure_node(node, key.with_suffix(".pub").read_text())
        write_inventory(topology, self.inventory)
        write_ansible_vars(self.project, "local", topology.serving)
        self.write_release(topology, images, model)
        say("ansible: playbooks/site.yml (baseline, container runtime, serving) against inventories/local")
        self.play("site.yml", say=say)
        status = self.status(topology)
        say("smoke: one completion through the gateway with the openai client")
        status["smoke"] = smoke_completion(status["gateway_url"], self.secrets.api_key, topology.serving.model.name)
        return status

    def write_release(self, topology: Topology, images: Images, model: Path) -> None:
        # The serving settings travel in the contract (playbooks/vars/contract/local.yml); the release's config
        # version follows them, so a changed limit or port is a new configuration.
        rendered = {"contract": ansible_vars(contract(topology.serving)), "local": LOCAL_RATE_LIMITS}
        config_version = hashlib.sha256(json.dumps(rendered, sort_keys=True).encode()).hexdigest()[:8]
        release = {
            "pdstack_release": {"version": images.release_version, "image": images.runtime,
                                "config_version": config_version},
            "pdstack_prometheus_image": images.prometheus,
            "pdstack_model": {"name": topology.serving.model.name, "source": str(model)},
            "pdstack_model_dest": topology.serving.model.path,
            "pdstack_secrets_dir": str(self.secrets.folder),
            "pdserve_env": LOCAL_RATE_LIMITS,
        }  # fmt: skip
        self.release_file.write_text(json.dumps(release, indent=2) + "\n")

    def playbook_argv(self, playbook: str, *args: str) -> list[str]:
        """`ansible-playbook` of `playbooks/<playbook>` against the local inventory, with the current release."""
        return [str(self.project / ".venv" / "bin" / "ansible-playbook"), "-i", str(self.inventory),
                str(self.project / "playbooks" / playbook), "-e", f"@{self.release_file}", *args]  # fmt: skip

    def play(self, playbook: str, *args: str, say: Callable[[str], None] = print) -> str:
        """Run a playbook (see playbook_argv); its output goes to `say` line by line and is returned; a failed run
        raises with the output's tail."""
        env = {**os.environ, "ANSIBLE_CONFIG": str(self.project / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
        process = subprocess.Popen(self.playbook_argv(playbook, *args), cwd=self.project, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            say(line.rstrip("\n"))
        output = "".join(lines)
        if process.wait() != 0:
            raise PlaybookError(f"ansible-playbook {playbook} failed (exit {process.returncode}):\n{output[-4000:]}")
        return output

    def down(self, say: Callable[[str], None] = print) -> None:
        topology = self.topology()
        for node in topology.nodes:
            say(f"nodes: removing {node.name}")
            nodes.remove_node(node.name)
        say("registry: stopping")
        self.registry().stop()
        say("network: removing namespaces, links and rules")
        self.network(topology).down()

    # -- status ---------------------------------------------------------------------------------------------------

    def status(self, topology: Topology | None = None) -> dict[str, Any]:
        topology = topology or self.topology()
        gateway = topology.nodes_with_role(PoolRole.CONTROL)[0].address.ip
        served = contract(topology.serving)
        by_dc: dict[str, list[dict[str, Any]]] = {}
        for node in topology.nodes:
            by_dc.setdefault(node.datacenter, []).append(
                {
                    "name": node.name,
                    "role": str(node.role),
                    "address": str(node.address.ip),
                    "running": nodes.node_exists(node.name),
                }
            )
        return {
            "gateway_url": f"http://{gateway}:{served[Component.GATEWAY].port}/v1",
            "api_key_file": str(self.secrets.api_key),
            "prometheus_url": f"http://{gateway}:{served.prometheus.port}",
            "registry": self.registry().endpoint,
            "nodes": by_dc,
            "leftovers": self.network(topology).leftovers(),
        }


def ensure_node(node: Node, public_key: str) -> None:
    """Start the node container in its network namespace (unless it already runs) and let our SSH key in."""
    if not (nodes.node_exists(node.name) and _running(node.name)):
        nodes.create_node(nodes.NodeSpec(node.name, extra_args=("--network", f"ns:/run/netns/{node.namespace}")))
    nodes.authorize_ssh_key(node.name, public_key)


def smoke_completion(base_url: str, api_key_file: Path, model: str) -> str:
    """One completion through the gateway with the official openai client; returns the generated text."""
    client = OpenAI(base_url=base_url, api_key=api_key_file.read_text().strip(), timeout=60, max_retries=3)
    completion = client.completions.create(
        model=model, prompt="Prefill in one datacenter, decode in the other: " * 3, max_tokens=8, temperature=0
    )
    return completion.choices[0].text


def _running(name: str) -> bool:
    out = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.Running}}", name], capture_output=True, text=True, check=False
    ).stdout
    return out.strip() == "true"
