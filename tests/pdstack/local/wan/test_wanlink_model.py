"""The emulated WAN link's packet schedule: serialisation at the rate, one-way delay, queue limit and loss."""

from __future__ import annotations

import random

import pytest

from pdstack.local.wan import LinkDirection, LinkShape, default_endpoints, link_command
from pdstack.local.wan.__main__ import _parser


def test_back_to_back_packets_leave_at_the_link_rate_and_arrive_after_the_delay():
    spec = LinkShape(rate_mbit=80, rtt_ms=20)  # 10 MB/s: a 10 000-byte packet takes 1 ms to serialise
    direction = LinkDirection(spec, random.Random(1))
    deliveries = [direction.schedule(now=5.0, size=10_000) for _ in range(3)]
    assert deliveries == pytest.approx([5.011, 5.012, 5.013])


def test_idle_link_delivers_a_late_packet_after_its_own_serialisation_only():
    direction = LinkDirection(LinkShape(rate_mbit=80, rtt_ms=20), random.Random(1))
    direction.schedule(now=0.0, size=10_000)
    assert direction.schedule(now=1.0, size=10_000) == pytest.approx(1.011)


def test_queue_beyond_one_bandwidth_delay_product_is_tail_dropped():
    spec = LinkShape(rate_mbit=80, rtt_ms=20)
    assert spec.queue_limit_bytes == 200_000
    direction = LinkDirection(spec, random.Random(1))
    outcomes = [direction.schedule(now=0.0, size=10_000) for _ in range(25)]
    assert all(outcome is not None for outcome in outcomes[:20])
    assert all(outcome is None for outcome in outcomes[20:])
    assert direction.stats.dropped_queue == 5 and direction.stats.forwarded == 20


def test_loss_drops_about_the_configured_share():
    direction = LinkDirection(LinkShape(rate_mbit=1000, rtt_ms=0, loss_pct=25, queue_bytes=10**9), random.Random(7))
    for packet in range(20_000):
        direction.schedule(now=packet * 1.0, size=1_000)
    assert 0.2 < direction.stats.dropped_loss / 20_000 < 0.3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"rate_mbit": 0, "rtt_ms": 20}, "rate_mbit"),
        ({"rate_mbit": 10, "rtt_ms": -1}, "rtt_ms"),
        ({"rate_mbit": 10, "rtt_ms": 1, "loss_pct": 100}, "loss_pct"),
        ({"rate_mbit": 10, "rtt_ms": 1, "queue_bytes": 1500}, "queue_bytes"),
    ],
)
def test_bad_link_settings_name_the_field(fields: dict[str, float], message: str):
    with pytest.raises(ValueError, match=message):
        LinkShape(**fields)  # type: ignore[arg-type]


def test_cli_arguments_round_trip_through_the_parser():
    a, b = default_endpoints("dc-a", "dc-b", "10.9.0.0/24")
    args = _parser().parse_args(link_command(a, b, LinkShape(1000, 20, 0.5, 4_000_000), seed=3)[3:])
    assert (args.ns_a, args.ns_b, str(args.addr_a), str(args.addr_b)) == ("dc-a", "dc-b", "10.9.0.1/24", "10.9.0.2/24")
    assert (args.rate_mbit, args.rtt_ms, args.loss_pct, args.queue_bytes, args.seed) == (1000, 20, 0.5, 4_000_000, 3)
