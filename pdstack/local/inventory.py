"""The Ansible inventory of the local environment, rendered from the local stacks.

Groups mirror the aws_ec2 inventory's keyed groups (by role and by datacenter), so the same playbooks run on both.
As the aws_ec2 inventory lists the instances an Auto Scaling group launched, the folder lists the nodes `pdstack
local scale` launched (launched.yml, written at each scale, not committed) beside the stack's own: the operators'
plays (`-i inventories/local`: deploy.yml's canary, rollback.yml) reach both. `up` converges only the control nodes
with site.yml: every GPU node booted from its pool's user data and applied the same roles to itself.
The rendered file is committed (inventories/local/hosts.yml) so readers see it; a test keeps it equal to this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdstack.contract.yamlfiles import dump_yaml
from pdstack.local.engine_choice import LOCAL_VLLM_SIZING
from pdstack.local.names import host_entries
from pdstack.local.network import MTU as LINK_MTU
from pdstack.local.nodes import BOOT_TIMEOUT_S
from pdstack.local.registry import PORT as REGISTRY_PORT
from pdstack.local.topology import LOCAL_SUPERNET, SERVICE_ADDRESS, Node, Topology
from pdstack.model import PoolRole

HEADER = "# Rendered by `pdstack local inventory` from stacks/Pulumi.local-*.yaml; do not edit by hand.\n"
PLATFORM_HEADER = (
    "# What the local platform gives a node booting from its user data (pdstack.local.inventory.node_platform),\n"
    "# rendered by `pdstack local up` from stacks/Pulumi.local-*.yaml (a test keeps it current); do not edit by hand.\n"
)
PLATFORM_FILE = Path("playbooks/vars/platform/local.yml")
LAUNCHED_FILE = "launched.yml"  # beside hosts.yml, not committed: the nodes `pdstack local scale` launched
LAUNCHED_HEADER = "# Written by `pdstack local scale`: the nodes the pools' groups launched; do not edit by hand.\n"
SSH_KEY = "{{ inventory_dir }}/../../.cache/local/ssh/id_ed25519"  # made by `pdstack local up`

# Ansible reaches the nodes over SSH at their datacenter addresses, as it reaches cloud nodes.
CONNECTION_VARS: dict[str, Any] = {
    "ansible_user": "root",
    "ansible_become": False,  # root already; the nodes have no sudo
    "ansible_python_interpreter": "/usr/bin/python3",
    "ansible_ssh_private_key_file": SSH_KEY,
    "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
    "ansible_ssh_pipelining": True,
}
# What differs from a cloud node because a local node is a container on this host: podman runs nested (runc with
# cgroupfs, and the host's cgroup tree mounted in, as runc cannot mount it on a cgroup v1/hybrid host), and the
# control node is the site's time server (no public NTP is reachable).
NESTED_NODE_VARS: dict[str, Any] = {
    "container_runtime_oci_runtime": "runc",
    "container_runtime_cgroup_manager": "cgroupfs",
    "container_runtime_events_logger": "file",
    "container_runtime_default_ulimits": ["nofile=20000:20000", "nproc=4096:4096"],
    "container_runtime_nvidia_cdi": False,
    "pdserve_extra_volumes": ["/sys/fs/cgroup:/sys/fs/cgroup:ro"],
    "prometheus_extra_volumes": ["/sys/fs/cgroup:/sys/fs/cgroup:ro"],
    "numa_serving_nics": ["eth0"],
    "time_sync_pools": [],
}


def _registry_vars() -> dict[str, Any]:
    return {
        "pdstack_registry": f"{SERVICE_ADDRESS}:{REGISTRY_PORT}",
        "container_runtime_registries": [{"location": f"{SERVICE_ADDRESS}:{REGISTRY_PORT}", "insecure": True}],
    }


def _link_vars(topology: Topology, name: str) -> dict[str, Any]:
    """Socket buffers sized for the longest fat pipe a datacenter's nodes use (none: the roles' defaults)."""
    widest = max(
        (link for link in topology.links if name in (link.a, link.b)),
        key=lambda link: link.rate_mbit * link.rtt_ms,
        default=None,
    )
    if widest is None:
        return {}
    return {
        "kernel_tuning_link_bandwidth_gbps": widest.rate_mbit / 1000,
        "kernel_tuning_link_rtt_ms": widest.rtt_ms,
        "kernel_tuning_peer_links": peer_links(topology, name),
        "kernel_tuning_link_mtu": int(LINK_MTU),  # node, router and WAN devices all carry it
    }


def node_platform(topology: Topology) -> dict[str, Any]:
    """What the local environment's platform gives a node that boots from its user data (playbooks/node.yml loads it
    as vars/platform/local.yml from the node bundle): what the operators' inventory gives its converged nodes beyond
    the stacks, so both kinds of node are configured alike. By datacenter where it differs."""
    return {
        "pdstack_platform": "local",
        **_registry_vars(),
        **NESTED_NODE_VARS,
        "time_sync_servers": [str(topology.nodes_with_role(PoolRole.CONTROL)[0].address.ip)],
        # as the cloud's stacks.yml gives them (playbooks/vars/node.yml's pdstack_node_links): node.yml sizes the
        # kernel's buffers from the node's datacenter's entry
        "kernel_tuning_link_mtu": int(LINK_MTU),
        "pdstack_platform_links": {
            dc.name: {
                k.removeprefix("kernel_tuning_"): v for k, v in _link_vars(topology, dc.name).items() if "mtu" not in k
            }
            for dc in topology.datacenters
        },
        "pdstack_node_links": "{{ pdstack_platform_links[pdstack_datacenter] | default({}) }}",
        "pdstack_hosts": host_entries(topology),
        **LOCAL_VLLM_SIZING,  # read only when the node runs vLLM (up --engine vllm)
    }


def render_node_platform(topology: Topology) -> str:
    return PLATFORM_HEADER + "---\n" + dump_yaml(node_platform(topology), width=120)


def render_inventory(topology: Topology) -> str:
    return HEADER + yaml.safe_dump(inventory(topology), sort_keys=False, default_flow_style=False)


def _hosts(nodes: list[Node]) -> dict[str, dict[str, str]]:
    return {
        node.name: {
            "ansible_host": str(node.address.ip),
            "pdstack_address": str(node.address.ip),
            "pdstack_datacenter": node.datacenter,
            "pdstack_role": str(node.role),
            "pdstack_pool": node.pool,
        }
        for node in nodes
    }


def launched_inventory(topology: Topology) -> dict[str, Any] | None:
    """The nodes `pdstack local scale` launched, in their role's and datacenter's groups (whose variables the stack's
    inventory sets); None without any."""
    launched = [n for n in topology.nodes if n.launched]
    if not launched:
        return None
    children: dict[str, Any] = {}
    for node in launched:
        for group in (str(node.role), f"dc_{node.datacenter}"):
            children.setdefault(group, {"hosts": {}})["hosts"][node.name] = None
    return {"all": {"children": {"nodes": {"hosts": _hosts(launched), "children": children}}}}


def inventory(topology: Topology) -> dict[str, Any]:
    """The stacks' own nodes (committed as inventories/local/hosts.yml)."""
    own = list(topology.stack_nodes)
    hosts = _hosts(own)
    children: dict[str, Any] = {
        str(role): {"hosts": {n.name: None for n in own if n.role is role}} for role in PoolRole
    }
    time_server = str(topology.nodes_with_role(PoolRole.CONTROL)[0].address.ip)
    children[str(PoolRole.CONTROL)]["vars"] = {
        "time_sync_servers": [],
        "time_sync_local_stratum": 10,
        "time_sync_allow": [str(LOCAL_SUPERNET)],
        # Six targets on one machine: a 1 s scrape gives a 20 s canary window ten independent latency points.
        "prometheus_scrape_interval": "1s",
        # the gateway is ready once a decode is routable, and up boots the GPU nodes beside site.yml's control plays
        "pdserve_ready_timeout_s": BOOT_TIMEOUT_S,
    }
    for dc in topology.datacenters:
        children[f"dc_{dc.name}"] = {
            "hosts": {n.name: None for n in dc.nodes if not n.launched},
            "vars": _link_vars(topology, dc.name),
        }
    return {
        "all": {
            "vars": {"pdstack_environment": "local", **_registry_vars()},
            "children": {
                "nodes": {
                    # on `nodes`, not `all`: the playbooks' controller plays (implicit localhost) stay local
                    "vars": {**CONNECTION_VARS, **NESTED_NODE_VARS, "time_sync_servers": [time_server]},
                    "hosts": hosts,
                    "children": children,
                }
            },
        }
    }


def peer_links(topology: Topology, name: str) -> list[dict[str, Any]]:
    """kernel_tuning's routes: each peer datacenter's subnet and the link to it (a one-BDP initial window)."""
    cidrs = {dc.name: str(dc.network) for dc in topology.datacenters}
    return [
        {
            "cidr": cidrs[link.b if link.a == name else link.a],
            "bandwidth_gbps": link.rate_mbit / 1000,
            "rtt_ms": link.rtt_ms,
        }
        for link in topology.links
        if name in (link.a, link.b)
    ]


def write_inventory(topology: Topology, folder: Path) -> bool:
    """Write the inventory folder: the stack's own nodes (hosts.yml) and those a group launched (LAUNCHED_FILE, gone
    without any); True when either changed."""
    changed = _write_if_changed(folder / "hosts.yml", render_inventory(topology))
    launched, path = launched_inventory(topology), folder / LAUNCHED_FILE
    if launched is None:
        if not path.exists():
            return changed
        path.unlink()
        return True
    text = LAUNCHED_HEADER + yaml.safe_dump(launched, sort_keys=False, default_flow_style=False)
    return _write_if_changed(path, text) or changed


def write_node_platform(topology: Topology, project: Path) -> bool:
    return _write_if_changed(project / PLATFORM_FILE, render_node_platform(topology))


def _write_if_changed(path: Path, text: str) -> bool:
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True
