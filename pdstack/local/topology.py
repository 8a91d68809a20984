"""The local environment's shape, derived from the `local` stacks: datacenters, their nodes and addresses, links.

Nothing here touches the machine; `network.py` builds what this describes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from pathlib import Path

from pdstack.model import DatacenterRole, Environment, PoolRole, Serving
from pdstack.stacks.environment import EnvironmentLoadError, load_environment
from pdstack.stacks.files import StackFile

LOCAL_SUPERNET = IPv4Network("10.210.0.0/16")
SERVICE_ADDRESS = IPv4Address("10.210.255.1")  # the host as every node sees it: registry, package proxy
UPLINK_NET = IPv4Network("10.211.0.0/24")  # host <-> datacenter router, a /30 each
WAN_NET = IPv4Network("10.212.0.0/24")  # datacenter router <-> datacenter router, a /30 per link
FIRST_NODE_HOST = 10  # node i of a datacenter gets the network's address .10 + i
# Every GPU node boots from its pool's user data; those a pool's group launched beyond the stack's desired size
# (`pdstack local scale`) get .100 + LAUNCHED_PER_POOL * p + j (pool p of a datacenter), so growing one pool never moves
# another's nodes.
FIRST_LAUNCHED_HOST = 100
LAUNCHED_PER_POOL = 20
PREFIX = "pds"


def short(kind: str, name: str) -> str:
    """A network device or namespace name of at most 15 bytes, stable for a given (kind, name)."""
    full = f"{PREFIX}{kind}-{name}"
    if len(full) <= 15:
        return full
    return f"{PREFIX}{kind}-{hashlib.sha256(name.encode()).hexdigest()[: 15 - len(PREFIX) - len(kind) - 1]}"


@dataclass(frozen=True)
class Node:
    name: str
    datacenter: str
    role: PoolRole
    pool: str
    address: IPv4Interface
    launched: bool = False  # beyond its stack's desired size (pdstack local scale)

    @property
    def boots_from_user_data(self) -> bool:
        """A GPU node: its pool's group boots it from the pool's user data, as in the cloud (pdstack.local.groups);
        the control nodes are converged by site.yml."""
        return self.role.needs_gpu

    @property
    def namespace(self) -> str:
        return f"{PREFIX}n-{self.name}"


@dataclass(frozen=True)
class LocalDatacenter:
    name: str
    role: DatacenterRole
    network: IPv4Network
    index: int
    nodes: tuple[Node, ...]
    pools: tuple[tuple[str, PoolRole], ...] = ()  # its pools in the stack's order (their launched addresses follow it)

    def pool_role(self, pool: str) -> PoolRole:
        return dict(self.pools)[pool]

    @property
    def router_namespace(self) -> str:
        return f"{PREFIX}r-{self.name}"

    @property
    def gateway(self) -> IPv4Interface:
        return IPv4Interface(f"{self.network.network_address + 1}/{self.network.prefixlen}")

    @property
    def uplink_host(self) -> IPv4Interface:
        return IPv4Interface(f"{UPLINK_NET.network_address + 4 * self.index + 1}/30")

    @property
    def uplink_router(self) -> IPv4Interface:
        return IPv4Interface(f"{UPLINK_NET.network_address + 4 * self.index + 2}/30")

    @property
    def uplink_device(self) -> str:
        return short("u", self.name)


@dataclass(frozen=True)
class LocalLink:
    a: str
    b: str
    rate_mbit: float
    rtt_ms: float
    loss_pct: float
    index: int

    def addresses(self) -> tuple[IPv4Interface, IPv4Interface]:
        base = WAN_NET.network_address + 4 * self.index
        return IPv4Interface(f"{base + 1}/30"), IPv4Interface(f"{base + 2}/30")

    def device_towards(self, peer: str) -> str:
        return short("w", peer)


@dataclass(frozen=True)
class Topology:
    datacenters: tuple[LocalDatacenter, ...]
    links: tuple[LocalLink, ...]
    serving: Serving

    @property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(node for dc in self.datacenters for node in dc.nodes)

    def datacenter(self, name: str) -> LocalDatacenter:
        return next(dc for dc in self.datacenters if dc.name == name)

    def nodes_with_role(self, role: PoolRole) -> list[Node]:
        return [node for node in self.nodes if node.role is role]

    @property
    def stack_nodes(self) -> tuple[Node, ...]:
        """The nodes of the stacks' desired sizes (inventories/local/hosts.yml): not those `scale` launched beyond."""
        return tuple(node for node in self.nodes if not node.launched)

    @property
    def converged_nodes(self) -> tuple[Node, ...]:
        """The nodes `up` converges with site.yml: the control plane's; the GPU nodes boot from their user data."""
        return tuple(node for node in self.nodes if not node.boots_from_user_data)

    @property
    def gpu_pools(self) -> list[tuple[str, str]]:
        """(datacenter, pool) of every pool whose group boots its nodes."""
        return [(dc.name, pool) for dc in self.datacenters for pool, role in dc.pools if role.needs_gpu]

    def pool_nodes(self, datacenter: str, pool: str) -> list[Node]:
        return [node for node in self.nodes if node.datacenter == datacenter and node.pool == pool]

    def pool_addresses(self, datacenter: str, pool: str) -> list[str]:
        """Every address a node of the pool may have: its converged nodes' and the whole launched range (a pool's
        certificate carries them all, so scaling never reissues it)."""
        dc = self.datacenter(datacenter)
        index = [name for name, _ in dc.pools].index(pool)
        launched = [_launched_address(dc.network, index, j) for j in range(LAUNCHED_PER_POOL)]
        converged = [n.address for n in self.pool_nodes(datacenter, pool) if not n.launched]
        return [str(a.ip) for a in [*converged, *launched]]


class TopologyError(ValueError):
    pass


Capacity = dict[tuple[str, str], int]  # (datacenter, pool) -> the group's desired capacity, where `scale` set one


def load_topology(stacks_dir: Path, capacity: Capacity | None = None) -> Topology:
    """The local environment of `stacks_dir`, validated first (pdstack.stacks.environment): an invalid stack never
    reaches the machine."""
    try:
        local = load_environment(stacks_dir, Environment.LOCAL)
    except EnvironmentLoadError as exc:
        raise TopologyError(str(exc)) from None
    return topology_of(list(local.stacks), capacity)


def _launched_address(network: IPv4Network, pool_index: int, j: int) -> IPv4Interface:
    if j >= LAUNCHED_PER_POOL:
        raise TopologyError(f"a local pool launches at most {LAUNCHED_PER_POOL} nodes beyond its stack's desired size")
    address = network.network_address + FIRST_LAUNCHED_HOST + LAUNCHED_PER_POOL * pool_index + j
    return IPv4Interface(f"{address}/{network.prefixlen}")


def topology_of(stacks: list[StackFile], capacity: Capacity | None = None) -> Topology:
    ordered = sorted(stacks, key=lambda s: s.config.datacenter.name)
    datacenters: list[LocalDatacenter] = []
    for index, stack in enumerate(ordered):
        dc = stack.config.datacenter
        if not dc.cidr.subnet_of(LOCAL_SUPERNET):
            raise TopologyError(f"{stack.path}: pdstack:datacenter.cidr: local datacenters live in {LOCAL_SUPERNET}")
        nodes: list[Node] = []
        launched: list[Node] = []
        first = FIRST_NODE_HOST  # a pool's stack nodes keep their addresses when an earlier pool is scaled in
        for p, pool in enumerate(dc.pools):
            wanted = (capacity or {}).get((dc.name, pool.name), pool.desired_size)
            for i in range(1, min(wanted, pool.desired_size) + 1):
                address = dc.cidr.network_address + first + i - 1
                nodes.append(
                    Node(
                        f"{dc.name}-{pool.name}-{i}",
                        dc.name,
                        pool.role,
                        pool.name,
                        IPv4Interface(f"{address}/{dc.cidr.prefixlen}"),
                    )
                )
            first += pool.desired_size
            for j, i in enumerate(range(pool.desired_size + 1, wanted + 1)):
                address = _launched_address(dc.cidr, p, j)
                launched.append(Node(f"{dc.name}-{pool.name}-{i}", dc.name, pool.role, pool.name, address, True))
        nodes += launched
        pools = tuple((p.name, p.role) for p in dc.pools)
        datacenters.append(LocalDatacenter(dc.name, dc.role, dc.cidr, index, tuple(nodes), pools))
    links: dict[frozenset[str], LocalLink] = {}
    for stack in ordered:
        here = stack.config.datacenter.name
        for spec in stack.config.datacenter.links:
            key = frozenset((here, spec.peer))
            if key not in links:
                a, b = sorted(key)
                links[key] = LocalLink(a, b, spec.bandwidth_gbps * 1000, spec.rtt_ms, spec.loss_pct, len(links))
    serving = next((s.config.serving for s in ordered if s.config.serving is not None), None)
    if serving is None:
        raise TopologyError("no local stack has pdstack:serving (the control-plane stack holds it)")
    return Topology(tuple(datacenters), tuple(links.values()), serving)
