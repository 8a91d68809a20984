"""The local environment's DNS names (#17): the contract's scheme (`Names`) under the zone `local.pdstack`, e.g.
gateway.control.local.pdstack, and where they resolve.

There is no DNS server locally. The names reach the host (where `pdstack local status`, the tests and a user's
openai client run) as a managed block in /etc/hosts that `up` writes and `down` removes, and the nodes and the
containers on them as the same entries (the pdserve role's /etc/hosts block and podman's --add-host). A hosts block
rather than a resolver: one file every resolver on the machine (glibc, Python, curl, the openai client) already
reads, nothing to run or to point the host's resolv.conf at, and a line-for-line undo on `down`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pdstack.contract.components import Names
from pdstack.local.tls import Leaf
from pdstack.local.topology import Node, Topology
from pdstack.model import PoolRole

LOCAL_ZONE = "local.pdstack"
NAMES = Names(LOCAL_ZONE)
CONTROL_SERVICES = ("gateway", "scheduler", "prometheus")  # what a control node serves, each by its own name
HOSTS_FILE = Path("/etc/hosts")
BEGIN = "# BEGIN pdstack local environment (pdstack local up writes this block, down removes it)"
END = "# END pdstack local environment"


def node_name(node: Node) -> str:
    """The node's own name: under its pool's name (the wildcard its pool's certificates would carry)."""
    return f"{node.name}.{NAMES.host(node.pool, node.datacenter)}"


def service_names(node: Node) -> tuple[str, ...]:
    """The names the node's listeners are reached by: gateway, scheduler, Prometheus on a control node; its pool's
    name on a server node."""
    if node.role is PoolRole.CONTROL:
        return tuple(NAMES.host(service, node.datacenter) for service in CONTROL_SERVICES)
    return (NAMES.host(node.pool, node.datacenter),)


def dns_names(node: Node) -> tuple[str, ...]:
    """Every name its certificate carries: the service names first (the first is the common name), then its own."""
    return (*service_names(node), node_name(node))


def control_node(topology: Topology) -> Node:
    return topology.nodes_with_role(PoolRole.CONTROL)[0]


def service_name(topology: Topology, service: str) -> str:
    """gateway.control.local.pdstack and the like: a control-plane service's name."""
    return NAMES.host(service, control_node(topology).datacenter)


def host_entries(topology: Topology) -> dict[str, str]:
    """name -> address of every name in the environment. A pool of several nodes resolves to its first: the names
    callers use are the control plane's; the servers register and are reached by address (their certificates carry
    it), so a pool's name is for people and logs."""
    entries: dict[str, str] = {}
    for node in topology.nodes:
        for name in dns_names(node):
            entries.setdefault(name, str(node.address.ip))
    return entries


def hosts_block(entries: dict[str, str]) -> str:
    lines = [f"{address} {name}" for name, address in entries.items()]
    return "\n".join([BEGIN, *lines, END]) + "\n"


def without_block(text: str) -> str:
    """`text` with the managed block (if any) taken out, everything else as it was."""
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == BEGIN:
            inside = True
        elif inside and line.rstrip("\n") == END:
            inside = False
        elif not inside:
            out.append(line)
    return "".join(out)


def write_hosts(entries: dict[str, str], path: Path = HOSTS_FILE) -> bool:
    """Put the block in `path` (replacing an older one); True when the file changed."""
    before = path.read_text() if path.exists() else ""
    rest = without_block(before)
    if rest and not rest.endswith("\n"):
        rest += "\n"
    return _replace(path, before, rest + hosts_block(entries))


def remove_hosts(path: Path = HOSTS_FILE) -> bool:
    """Take the block out of `path`; True when there was one."""
    if not path.exists():
        return False
    before = path.read_text()
    return _replace(path, before, without_block(before))


def _replace(path: Path, before: str, after: str) -> bool:
    if after == before:
        return False
    fd, temporary = tempfile.mkstemp(prefix=".hosts-", dir=path.parent)
    try:  # a new file renamed over the old: no reader sees half a hosts file
        with os.fdopen(fd, "w") as out:
            out.write(after)
        os.chmod(temporary, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(temporary, path)
    except OSError:  # a bind-mounted /etc/hosts (a container's) cannot be renamed over: write it in place
        path.write_text(after)
    finally:
        Path(temporary).unlink(missing_ok=True)
    return True


def leaves(topology: Topology) -> list[Leaf]:
    """One certificate per node: its names and its address."""
    return [Leaf(node.name, dns_names(node), (str(node.address.ip),)) for node in topology.nodes]
