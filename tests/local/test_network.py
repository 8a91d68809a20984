"""The local environment's networks, built for real: namespaces, bridges, routes and emulated WAN links."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator

import pytest

from pdstack.local.network import LocalNetwork, namespaces
from pdstack.local.topology import SERVICE_ADDRESS, Topology, load_topology
from tests.conftest import STACKS


@pytest.fixture(scope="module")
def topology() -> Topology:
    return load_topology(STACKS)


@pytest.fixture(scope="module")
def network(topology: Topology, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNetwork]:
    net = LocalNetwork(topology, tmp_path_factory.mktemp("net"))
    net.up()
    yield net
    net.down()


def ping_rtts_ms(namespace: str, address: str, count: int = 5) -> list[float]:
    out = subprocess.run(["ip", "netns", "exec", namespace, "ping", "-c", str(count), "-i", "0.2", address],
                         capture_output=True, text=True, check=True).stdout
    return [float(m) for m in re.findall(r"time=([\d.]+) ms", out)]


def test_topology_follows_the_local_stacks(topology: Topology) -> None:
    assert [dc.name for dc in topology.datacenters] == ["control", "dc1", "dc2"]
    assert [n.name for n in topology.nodes] == ["control-control-1", "dc1-prefill-1", "dc1-prefill-2",
                                                "dc2-decode-1", "dc2-decode-2"]
    wan = next(link for link in topology.links if {link.a, link.b} == {"dc1", "dc2"})
    assert (wan.rate_mbit, wan.rtt_ms) == (1000, 20)


def test_datacenters_reach_each_other_across_the_emulated_wan(topology: Topology, network: LocalNetwork) -> None:
    prefill, decode = topology.datacenter("dc1").nodes[0], topology.datacenter("dc2").nodes[0]
    rtts = ping_rtts_ms(prefill.namespace, str(decode.address.ip))
    assert len(rtts) == 5
    assert min(rtts) >= 20.0, "the link's 20 ms RTT must be felt by every packet"


def test_nodes_within_a_datacenter_do_not_cross_the_wan(topology: Topology, network: LocalNetwork) -> None:
    first, second = topology.datacenter("dc1").nodes
    assert max(ping_rtts_ms(first.namespace, str(second.address.ip))) < 20.0


def test_every_node_reaches_the_host_service_address(topology: Topology, network: LocalNetwork) -> None:
    for node in topology.nodes:
        assert ping_rtts_ms(node.namespace, str(SERVICE_ADDRESS), count=1)


def test_up_twice_changes_nothing(topology: Topology, network: LocalNetwork) -> None:
    before = sorted(namespaces()), [network.link_pid(link) for link in topology.links]
    network.up()
    assert (sorted(namespaces()), [network.link_pid(link) for link in topology.links]) == before


def test_down_leaves_nothing_behind(network: LocalNetwork) -> None:
    assert network.leftovers()
    network.down()
    assert network.leftovers() == []
    network.down()  # and a second `down` is harmless
