"""The link model: a link's shape (rate, round-trip delay, loss, queue) and the schedule of one direction."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

TUN_MTU = 65000


@dataclass(frozen=True)
class LinkShape:
    """The link's shape: rate, round-trip delay, random loss and queue size (bytes; None means one BDP)."""

    rate_mbit: float
    rtt_ms: float
    loss_pct: float = 0.0
    queue_bytes: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.rate_mbit < math.inf:
            raise ValueError(f"rate_mbit: must be a positive number, got {self.rate_mbit}")
        if not 0 <= self.rtt_ms < math.inf:
            raise ValueError(f"rtt_ms: must be a number, zero or more, got {self.rtt_ms}")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"loss_pct: must be in [0, 100), got {self.loss_pct}")
        if self.queue_bytes is not None and self.queue_bytes < TUN_MTU:
            raise ValueError(f"queue_bytes: must hold at least one {TUN_MTU}-byte packet, got {self.queue_bytes}")

    @property
    def bytes_per_second(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_ms / 2000

    @property
    def queue_limit_bytes(self) -> int:
        if self.queue_bytes is not None:
            return self.queue_bytes
        bdp = int(self.bytes_per_second * self.rtt_ms / 1000)
        return max(bdp, 2 * TUN_MTU)

    def describe(self) -> str:
        return f"rate {self.rate_mbit:g} Mbit/s, RTT {self.rtt_ms:g} ms, loss {self.loss_pct:g} %"


@dataclass
class DirectionStats:
    forwarded: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0


@dataclass
class LinkDirection:
    """One direction of the link: decides when each packet is delivered, or that it is dropped."""

    spec: LinkShape
    rng: random.Random
    stats: DirectionStats = field(default_factory=DirectionStats)
    _serialiser_free_at: float = 0.0

    def schedule(self, now: float, size: int) -> float | None:
        """Delivery time of a packet of `size` bytes that arrives at `now`, or None if the link drops it."""
        free_at = max(now, self._serialiser_free_at)
        backlog_bytes = round((free_at - now) * self.spec.bytes_per_second)
        if backlog_bytes + size > self.spec.queue_limit_bytes:
            self.stats.dropped_queue += 1
            return None
        if self.spec.loss_pct and self.rng.random() * 100 < self.spec.loss_pct:
            self.stats.dropped_loss += 1
            return None
        self._serialiser_free_at = free_at + size / self.spec.bytes_per_second
        self.stats.forwarded += 1
        return self._serialiser_free_at + self.spec.one_way_delay_s
