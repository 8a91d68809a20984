"""`pdstack local up | down | status`: all of pdstack on one machine, from the `local` stacks.

`up` validates the stacks, builds the networks and the emulated WAN, starts the registry, builds and pushes the images,
creates the node containers, runs `playbooks/site.yml` against them, and sends one completion through the gateway.
Every step is idempotent; `down` removes every container, namespace, link and rule that `up` made.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack import nodes
from pdstack.local.inventory import write_inventory
from pdstack.local.network import LocalNetwork
from pdstack.local.registry import Registry
from pdstack.local.secrets import LocalSecrets
from pdstack.local.topology import Node, Topology, load_topology
from pdstack.model import PoolRole

GATEWAY_PORT = 8000
PROMETHEUS_PORT = 9090


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
        self.registry().start()
        say("nodes: building the node image (cached) and starting node containers")
        nodes.build_node_image()
        for node in topology.nodes:
            ensure_node(node)
        write_inventory(topology, self.inventory)
        return self.status(topology)

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
            "gateway_url": f"http://{gateway}:{GATEWAY_PORT}/v1",
            "api_key_file": str(self.secrets.api_key),
            "prometheus_url": f"http://{gateway}:{PROMETHEUS_PORT}",
            "registry": self.registry().endpoint,
            "nodes": by_dc,
            "leftovers": self.network(topology).leftovers(),
        }


def ensure_node(node: Node) -> None:
    """Start the node container in its network namespace, unless it already runs."""
    if nodes.node_exists(node.name) and _running(node.name):
        return
    nodes.create_node(nodes.NodeSpec(node.name, extra_args=("--network", f"ns:/run/netns/{node.namespace}")))


def _running(name: str) -> bool:
    out = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.Running}}", name], capture_output=True, text=True, check=False
    ).stdout
    return out.strip() == "true"
