"""The emulated WAN link on real network namespaces: delay, rate cap, loss, changes while it runs, a clean teardown.

Needs root, /dev/net/tun, `ip`, `ping` and `iperf3`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdstack.local.wan import LinkProcess, LinkShape, LinkState, create_namespace, default_endpoints, delete_namespace
from pdstack.local.wan.control import reload_link
from pdstack.local.wan.tun import namespace_exists

RTT_MS = 20.0
RATE_MBIT = 100.0


def in_ns(namespace: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv_ns = ["ip", "netns", "exec", namespace, *argv]
    return subprocess.run(argv_ns, capture_output=True, text=True, timeout=timeout, check=False)


class Pair:
    def __init__(self, tag: str) -> None:
        self.ns_a, self.ns_b = f"wlt-{tag}-a-{os.getpid()}", f"wlt-{tag}-b-{os.getpid()}"
        self.a, self.b = default_endpoints(self.ns_a, self.ns_b)

    def __enter__(self) -> Pair:
        create_namespace(self.ns_a)
        create_namespace(self.ns_b)
        return self

    def __exit__(self, *_exc: object) -> None:
        delete_namespace(self.ns_a)
        delete_namespace(self.ns_b)


@pytest.fixture(scope="module")
def link() -> Iterator[Pair]:
    with Pair("net") as pair, LinkProcess(pair.a, pair.b, LinkShape(RATE_MBIT, RTT_MS)):
        yield pair


def ping(pair: Pair, count: int, interval: float) -> str:
    result = in_ns(pair.ns_a, "ping", "-q", "-c", str(count), "-i", str(interval), "-W", "1", str(pair.b.address.ip))
    return result.stdout


def test_ping_round_trip_is_at_least_the_configured_rtt(link: Pair):
    summary = ping(link, count=5, interval=0.2)
    rtt_min = float(re.search(r"= ([\d.]+)/", summary).group(1))  # type: ignore[union-attr]
    assert rtt_min >= RTT_MS


def test_tcp_throughput_is_capped_near_the_link_rate(link: Pair):
    server = subprocess.Popen(["ip", "netns", "exec", link.ns_b, "iperf3", "-s", "-1"], stdout=subprocess.DEVNULL)
    try:
        for _attempt in range(50):  # wait for the server socket, not for any amount of time
            if "5201" in in_ns(link.ns_b, "ss", "-ltn").stdout:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        result = in_ns(link.ns_a, "iperf3", "-c", str(link.b.address.ip), "-t", "3", "-J")
        received = json.loads(result.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        server.kill()
        server.wait()
    assert 0 < received <= 1.2 * RATE_MBIT
    assert received > 0.3 * RATE_MBIT  # a working link carries a good share of its rate


def test_loss_setting_drops_packets():
    with Pair("loss") as pair, LinkProcess(pair.a, pair.b, LinkShape(RATE_MBIT, 2.0, loss_pct=30), seed=11) as lossy:
        summary = ping(pair, count=100, interval=0.01)
    lost_pct = float(re.search(r"([\d.]+)% packet loss", summary).group(1))  # type: ignore[union-attr]
    # Each echo crosses the link twice, so about 51 % of them are lost; bounds are wide on purpose.
    assert 20 < lost_pct < 85
    assert lossy.stats["a_to_b"]["dropped_loss"] > 0 and lossy.stats["b_to_a"]["dropped_loss"] > 0


def tun_devices() -> list[str]:
    listing = subprocess.run(["ip", "-d", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [line.split(":")[1].strip() for line in listing.splitlines() if " tun " in line]


def test_teardown_leaves_no_namespace_or_device_behind():
    before = tun_devices()
    pair = Pair("down")
    with pair, LinkProcess(pair.a, pair.b, LinkShape(RATE_MBIT, RTT_MS)):
        assert "wan0" in in_ns(pair.ns_a, "ip", "-brief", "link").stdout
    assert not namespace_exists(pair.ns_a) and not namespace_exists(pair.ns_b)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert pair.ns_a not in listed and pair.ns_b not in listed
    assert tun_devices() == before


# -- changing a running link (`--control-file`, SIGHUP) ----------------------------------------------------------

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


@contextlib.contextmanager
def inside(namespace: str) -> Iterator[None]:
    """Run the block in `namespace`'s network; a socket made there stays there after the block."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def connected_tcp(pair: Pair) -> tuple[socket.socket, socket.socket]:
    """A TCP connection across the link: (client in A, server side in B)."""
    with inside(pair.ns_b):
        listener = socket.create_server((str(pair.b.address.ip), 0))
    with listener, inside(pair.ns_a):
        client = socket.create_connection((str(pair.b.address.ip), listener.getsockname()[1]), timeout=10)
        listener.settimeout(10)
        server, _peer = listener.accept()
    return client, server


def receive(sock: socket.socket, size: int, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def ping_loss_pct(pair: Pair, count: int = 5) -> float:
    return float(re.search(r"([\d.]+)% packet loss", ping(pair, count, 0.1)).group(1))  # type: ignore[union-attr]


def ping_rtts_ms(pair: Pair, count: int = 5) -> list[float]:
    result = in_ns(pair.ns_a, "ping", "-c", str(count), "-i", "0.2", "-W", "2", str(pair.b.address.ip))
    return [float(rtt) for rtt in re.findall(r"time=([\d.]+) ms", result.stdout)]


def device_indexes(pair: Pair) -> list[str]:
    """The interface index of each side's TUN device: a recreated device would get a new one."""
    return [in_ns(ns, "ip", "-o", "link", "show", "dev", "wan0").stdout.split(":")[0] for ns in (pair.ns_a, pair.ns_b)]


def running(link: LinkProcess) -> bool:
    return link._process is not None and link._process.poll() is None


@pytest.fixture
def shaped(tmp_path: Path) -> Iterator[tuple[Pair, LinkProcess]]:
    """A running link started with a control file."""
    spec = LinkShape(RATE_MBIT, RTT_MS)
    with Pair("ctl") as pair, LinkProcess(pair.a, pair.b, spec, seed=5, control_file=tmp_path / "link.json") as link:
        yield pair, link


def test_a_loss_spike_stops_traffic_and_the_same_link_recovers(shaped: tuple[Pair, LinkProcess]):
    pair, link = shaped
    pid, devices = link.pid, device_indexes(pair)
    client, server = connected_tcp(pair)
    with client, server:
        client.sendall(b"before")
        assert receive(server, 6, timeout_s=10) == b"before"
        assert ping_loss_pct(pair) == 0

        assert link.change(loss_pct=99.99) == LinkShape(RATE_MBIT, RTT_MS, 99.99)
        assert link.state().spec.loss_pct == 99.99
        assert ping_loss_pct(pair, count=10) == 100
        client.sendall(b"during")
        with pytest.raises(TimeoutError):
            receive(server, 6, timeout_s=1.5)  # nothing crosses for as long as the spike lasts

        assert link.change(loss_pct=0) == LinkShape(RATE_MBIT, RTT_MS, 0)
        assert receive(server, 6, timeout_s=30) == b"during"  # TCP's retransmission on the same connection
        assert ping_loss_pct(pair) == 0
    assert link.pid == pid and running(link)
    assert device_indexes(pair) == devices
    link.stop()
    # The spike ate the 10 echo requests and the segment's first sends (nothing got far enough to be answered).
    assert link.stats["a_to_b"]["dropped_loss"] > 10


def test_a_delay_change_shows_in_the_measured_round_trip(shaped: tuple[Pair, LinkProcess]):
    pair, link = shaped
    base = ping_rtts_ms(pair)
    assert link.change(rtt_ms=5 * RTT_MS).rtt_ms == 5 * RTT_MS
    slow = ping_rtts_ms(pair)
    assert link.change(rtt_ms=RTT_MS).rtt_ms == RTT_MS
    back = ping_rtts_ms(pair)
    assert len(base) == len(slow) == len(back) == 5
    assert min(slow) >= 5 * RTT_MS  # the forwarder never delivers before the delay
    assert statistics.median(slow) / statistics.median(base) > 3
    assert statistics.median(back) / statistics.median(slow) < 0.5


def test_a_rate_change_is_confirmed_and_keeps_the_other_fields(shaped: tuple[Pair, LinkProcess]):
    _pair, link = shaped
    link.change(loss_pct=2)
    assert link.change(rate_mbit=10) == LinkShape(10, RTT_MS, 2)
    assert link.state().reloads == 2


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "Expecting property name"),
        ("[30]", "expected a JSON object"),
        ('{"loss_pct": 150}', "loss_pct: must be in [0, 100)"),
        ('{"rtt_ms": "fast"}', "rtt_ms: must be a number"),
        ('{"rtt_ms": NaN}', "rtt_ms: must be a number"),
        ('{"loss_pct": true}', "loss_pct: must be a number"),
        ('{"los_pct": 5}', "unknown field 'los_pct'"),
        (None, "No such file"),
    ],
)
def test_a_bad_control_file_keeps_the_spec_and_the_link(
    shaped: tuple[Pair, LinkProcess], content: str | None, reason: str
):
    pair, link = shaped
    assert link.control_file is not None
    before = link.state()
    if content is None:
        link.control_file.unlink(missing_ok=True)
    else:
        link.control_file.write_text(content)
    state = reload_link(link.pid, link.control_file)
    assert state.error is not None and reason in state.error
    assert state.spec == before.spec and state.reloads == before.reloads + 1
    assert running(link) and ping_loss_pct(pair, count=3) == 0
    assert link.change(loss_pct=1).loss_pct == 1  # and a good file afterwards is applied
    link.stop()
    assert reason in link.stderr


def test_change_link_refuses_an_out_of_range_value_before_sending_it(shaped: tuple[Pair, LinkProcess]):
    _pair, link = shaped
    with pytest.raises(ValueError, match="rate_mbit"):
        link.change(rate_mbit=0)
    assert link.state() == LinkState(link.pid, 0, LinkShape(RATE_MBIT, RTT_MS))  # nothing was sent


def test_sighup_without_a_control_file_is_ignored():
    with Pair("hup") as pair, LinkProcess(pair.a, pair.b, LinkShape(RATE_MBIT, 2.0)) as link:
        os.kill(link.pid, signal.SIGHUP)
        assert ping_loss_pct(pair, count=3) == 0 and running(link)
    assert "SIGHUP ignored" in link.stderr
