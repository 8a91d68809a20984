"""The emulated WAN link on real network namespaces: delay, rate cap, loss and a clean teardown.

Needs root, /dev/net/tun, `ip`, `ping` and `iperf3`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator

import pytest

from pdstack.wanlink import (
    LinkProcess,
    LinkSpec,
    create_namespace,
    default_endpoints,
    delete_namespace,
    namespace_exists,
)

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
    with Pair("net") as pair, LinkProcess(pair.a, pair.b, LinkSpec(RATE_MBIT, RTT_MS)):
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
    with Pair("loss") as pair, LinkProcess(pair.a, pair.b, LinkSpec(RATE_MBIT, 2.0, loss_pct=30), seed=11) as lossy:
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
    with pair, LinkProcess(pair.a, pair.b, LinkSpec(RATE_MBIT, RTT_MS)):
        assert "wan0" in in_ns(pair.ns_a, "ip", "-brief", "link").stdout
    assert not namespace_exists(pair.ns_a) and not namespace_exists(pair.ns_b)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert pair.ns_a not in listed and pair.ns_b not in listed
    assert tun_devices() == before
