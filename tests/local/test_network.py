"""The local environment's networks, built for real: namespaces, bridges, routes and emulated WAN links.

The network is built with its real names and addresses, so it is built on a private "host": a network namespace of
its own (interfaces, routes, iptables, sysctls) and a mount namespace whose /run/netns starts empty. The machine's own
local environment, when it runs, is never seen nor touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdstack.local.env import LocalEnv
from pdstack.local.network import LocalNetwork, namespaces
from pdstack.local.topology import SERVICE_ADDRESS, Topology
from tests.conftest import REPO, STACKS

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


@contextlib.contextmanager
def private_host() -> Iterator[None]:
    """Run the block (this thread and the processes it starts) in a new network and mount namespace whose
    /run/netns is an empty tmpfs; back in the original namespaces afterwards."""
    saved = {flag: os.open(f"/proc/thread-self/ns/{kind}", os.O_RDONLY) for flag, kind in
             ((CLONE_NEWNET, "net"), (CLONE_NEWNS, "mnt"))}  # fmt: skip
    cwd = os.getcwd()
    try:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET))
        try:
            subprocess.run(["mount", "--make-rprivate", "/"], check=True)  # nothing mounted here reaches the host
            os.makedirs("/run/netns", exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "pdstack-test", "/run/netns"], check=True)
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
            if os.listdir("/run/netns") or namespaces():
                raise RuntimeError("the private /run/netns is not empty: refusing to build a network over the host's")
            yield
        finally:
            for flag, fd in saved.items():
                _check(_libc.setns(fd, flag))
            os.chdir(cwd)  # joining a mount namespace moves to its root
    finally:
        for fd in saved.values():
            os.close(fd)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project's stacks, with its own state folder (.cache/local) for the network and the CLI."""
    root = tmp_path_factory.mktemp("project")
    shutil.copy(REPO / "Pulumi.yaml", root)
    shutil.copytree(STACKS, root / "stacks")
    return root


@pytest.fixture(scope="module")
def topology(project: Path) -> Topology:
    return LocalEnv(project).topology()


@pytest.fixture(scope="module")
def network(project: Path, topology: Topology) -> Iterator[LocalNetwork]:
    with private_host():
        net = LocalEnv(project).network(topology)
        try:
            net.up()
            yield net
        finally:
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
