"""The local environment's networks, built for real: namespaces, bridges, routes and emulated WAN links.

The network is built with its real names and addresses, so it is built on a private "host": a network namespace of
its own (interfaces, routes, iptables, sysctls) and a mount namespace whose /run/netns starts empty. The machine's own
local environment, when it runs, is never seen nor touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from pdstack.cli import app
from pdstack.local.env import LocalEnv
from pdstack.local.network import LocalNetwork, NetworkError, UnknownLinkError, namespaces
from pdstack.local.topology import SERVICE_ADDRESS, LocalLink, Topology
from pdstack.local.wan import LinkShape
from tests.support import REPO, STACKS

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
    saved = {
        flag: os.open(f"/proc/thread-self/ns/{kind}", os.O_RDONLY)
        for flag, kind in ((CLONE_NEWNET, "net"), (CLONE_NEWNS, "mnt"))
    }
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
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "ping", "-c", str(count), "-i", "0.2", address],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [float(m) for m in re.findall(r"time=([\d.]+) ms", out)]


def test_an_unknown_link_is_named(project: Path, topology: Topology, tmp_path: Path) -> None:
    known = "links: control<->dc1, control<->dc2, dc1<->dc2"
    with pytest.raises(UnknownLinkError, match=f"no WAN link dc1<->dc9 in the local stacks \\({known}\\)"):
        LocalNetwork(topology, tmp_path).shape_link("dc1", "dc9", loss_pct=5)
    result = local_link(project, "dc1", "dc9", "--loss-pct", "5")
    assert result.exit_code == 1 and "no WAN link dc1<->dc9" in result.stderr


def test_a_link_that_is_not_running_is_named(topology: Topology, tmp_path: Path) -> None:
    with pytest.raises(NetworkError, match="WAN link dc1<->dc2 is not running"):
        LocalNetwork(topology, tmp_path).shape_link("dc2", "dc1", loss_pct=5)


def sighup_pending(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & 1 << (signal.SIGHUP - 1) for mask in pending)


def test_a_forwarder_without_a_control_file_is_never_signalled(topology: Topology, tmp_path: Path) -> None:
    # Stands in for a forwarder started by an older pdstack, which SIGHUP would end. It blocks SIGHUP, so a signal
    # sent to it would show as pending.
    code = "import signal as s, time; s.pthread_sigmask(s.SIG_BLOCK, {s.SIGHUP}); print(1, flush=True); time.sleep(60)"
    argv = [sys.executable, "-c", code, "-m", "pdstack.local.wan", "run"]
    older = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert older.stdout is not None and older.stdout.readline() == "1\n"
        (tmp_path / "link-dc1-dc2.pid").write_text(str(older.pid))
        with pytest.raises(NetworkError, match=f"forwarder \\(pid {older.pid}\\) was started without --control-file"):
            LocalNetwork(topology, tmp_path).shape_link("dc1", "dc2", loss_pct=5)
        assert not sighup_pending(older.pid)
        os.kill(older.pid, signal.SIGHUP)  # and the check above can see one
        assert sighup_pending(older.pid)
    finally:
        older.kill()
        older.wait()


def test_topology_follows_the_local_stacks(topology: Topology) -> None:
    assert [dc.name for dc in topology.datacenters] == ["control", "dc1", "dc2"]
    assert [n.name for n in topology.nodes] == [
        "control-control-1",
        "dc1-prefill-1",
        "dc1-prefill-2",
        "dc2-decode-1",
        "dc2-decode-2",
    ]
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


# -- changing a running WAN link: LocalNetwork.shape_link and `pdstack local link` ---------------------------------


def dc1_dc2(topology: Topology) -> LocalLink:
    return next(link for link in topology.links if {link.a, link.b} == {"dc1", "dc2"})


def ping_loss_pct(namespace: str, address: str, count: int = 10) -> float:
    # -w 5: a reply the user-space forwarder delivers late still counts as received (without a deadline, ping
    # gives up on the last ones after two round trips).
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "ping", "-q", "-c", str(count), "-i", "0.1", "-W", "1", "-w", "5", address],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return float(re.search(r"([\d.]+)% packet loss", out).group(1))  # type: ignore[union-attr]


def wan_device_index(topology: Topology) -> str:
    """The interface index of dc1's end of the WAN: a recreated TUN device would get a new one."""
    device = dc1_dc2(topology).device_towards("dc2")
    argv = ["ip", "-n", topology.datacenter("dc1").router_namespace, "-o", "link", "show", "dev", device]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split(":")[0]


def local_link(project: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["local", "link", *args, "--project", str(project)])


def test_a_loss_spike_cuts_dc1_from_dc2_until_the_declared_link_is_back(
    topology: Topology, network: LocalNetwork
) -> None:
    (prefill, other_prefill), decode = topology.datacenter("dc1").nodes, topology.datacenter("dc2").nodes[0]
    control = topology.datacenter("control").nodes[0]
    pid, device = network.link_pid(dc1_dc2(topology)), wan_device_index(topology)
    assert ping_loss_pct(prefill.namespace, str(decode.address.ip)) == 0

    status = network.shape_link("dc1", "dc2", loss_pct=99.99)
    assert status.pid == pid and status.spec == LinkShape(1000, 20, 99.99) and status.declared == LinkShape(1000, 20, 0)
    assert network.link_status("dc2", "dc1").spec == status.spec
    assert ping_loss_pct(prefill.namespace, str(decode.address.ip)) == 100
    assert ping_loss_pct(prefill.namespace, str(other_prefill.address.ip), count=3) == 0  # inside dc1: untouched
    assert ping_loss_pct(control.namespace, str(decode.address.ip), count=3) == 0  # control<->dc2: untouched

    status = network.shape_link("dc2", "dc1", reset=True)
    assert status.spec == status.declared == LinkShape(1000, 20, 0)
    assert ping_loss_pct(prefill.namespace, str(decode.address.ip)) == 0
    assert network.link_pid(dc1_dc2(topology)) == pid and wan_device_index(topology) == device


def test_pdstack_local_link_changes_the_delay_and_resets_it(
    project: Path, topology: Topology, network: LocalNetwork
) -> None:
    prefill, decode = topology.datacenter("dc1").nodes[0], topology.datacenter("dc2").nodes[0]
    base = ping_rtts_ms(prefill.namespace, str(decode.address.ip))

    result = local_link(project, "dc1", "dc2", "--rtt-ms", "100", "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown == {
        "link": "dc1<->dc2",
        "pid": network.link_pid(dc1_dc2(topology)),
        "spec": {"rate_mbit": 1000, "rtt_ms": 100, "loss_pct": 0},
        "declared": {"rate_mbit": 1000, "rtt_ms": 20, "loss_pct": 0},
    }
    slow = ping_rtts_ms(prefill.namespace, str(decode.address.ip))
    assert min(slow) >= 100  # never delivered before the delay
    # 80 ms more by the spec; differences, not ratios, so the forwarder's own delay on a busy host cancels out
    assert statistics.median(slow) - statistics.median(base) >= 0.8 * (100 - 20)

    result = local_link(project, "dc2", "dc1")  # no change: prints the spec in force
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "dc2<->dc1: rate 1000 Mbit/s, RTT 100 ms, loss 0 %\n"
        "  declared: rate 1000 Mbit/s, RTT 20 ms, loss 0 % (--reset goes back)\n"
    )
    result = local_link(project, "dc1", "dc2", "--reset")
    assert result.exit_code == 0, result.output
    assert result.stdout == "dc1<->dc2: rate 1000 Mbit/s, RTT 20 ms, loss 0 %\n"
    back = ping_rtts_ms(prefill.namespace, str(decode.address.ip))
    assert statistics.median(slow) - statistics.median(back) >= 0.8 * (100 - 20)


def test_concurrent_changes_of_one_link_are_queued_and_none_is_lost(network: LocalNetwork) -> None:
    start = threading.Barrier(2)

    def change(values: dict[str, float]) -> None:
        start.wait()
        network.shape_link("dc1", "dc2", **values)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(change, [{"rtt_ms": 40}, {"loss_pct": 1}]))
    try:
        assert network.link_status("dc1", "dc2").spec == LinkShape(1000, 40, 1)
    finally:
        network.shape_link("dc1", "dc2", reset=True)


def test_a_value_out_of_range_is_refused_and_the_link_kept(project: Path, network: LocalNetwork) -> None:
    with pytest.raises(ValueError, match=r"WAN link dc1<->dc2: loss_pct: must be in \[0, 100\)"):
        network.shape_link("dc1", "dc2", loss_pct=100)
    result = local_link(project, "dc1", "dc2", "--rate-mbit", "0", "--rtt-ms", "5")
    assert result.exit_code == 1 and "rate_mbit: must be a positive number" in result.stderr
    status = network.link_status("dc1", "dc2")
    assert status.spec == status.declared


def test_down_leaves_nothing_behind(network: LocalNetwork) -> None:
    assert network.leftovers()
    network.down()
    assert network.leftovers() == []
    network.down()  # and a second `down` is harmless
