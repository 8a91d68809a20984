"""Who holds a connection on prefill's KV port, and how the listener says what it dropped.

Before authentication a connection holds a slot: each source (an IPv4 address, an IPv6 /64) at most
`kv_max_handshakes_per_address`, all sources together at most `kv_max_handshakes`. A new connection is never refused
for want of a slot: it takes the slot of the oldest unauthenticated connection of its own source, or, when the
listener is full, of the source holding the most. So silent sockets or half-sent TLS ClientHellos, however many an
attacker keeps open, cannot keep a key holder's fresh handshake out (issue #33: 260 silent sockets made 18/18 of them
fail `capacity`). Every handshake, TLS included, must end within `kv_handshake_timeout_seconds`.

Authenticated connections (each serving pulls on its own thread) have a cap of their own, `kv_max_connections`:
beyond it a handshake is answered `capacity` instead of CHALLENGE, which decode retries (pdserve.kv.connect).

What the listener drops is counted by reason (KVMetrics.observe_dropped, reasons from DROP_REASONS only) and logged
at most once per `kv_drop_log_seconds`, one line with the counts since the last: a flood must not become a flood of
log lines (it was 35k warning lines, 11 MB, in 25 s).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Literal, Protocol

from pydantic import BaseModel, Field

from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics

log = logging.getLogger("pdserve.kv.server")

DropReason = Literal["evicted", "deadline", "handshake", "tls", "capacity"]
# evicted: an unauthenticated connection whose slot a newer one took; deadline: the handshake (TLS included) did not
# end in time; handshake: a bad HELLO/AUTH (wrong key, bad frame); tls: the TLS handshake failed; capacity: refused
# because kv_max_connections connections are authenticated.
DROP_REASONS: tuple[DropReason, ...] = ("evicted", "deadline", "handshake", "tls", "capacity")
IPV6_SOURCE_PREFIX = 64  # one IPv6 host usually owns a whole /64: counting its addresses apart would not cap it


class KVListenerSettings(BaseModel):
    """What prefill's KV listener admits before and after authentication (pdserve.kv.admission)."""

    kv_handshake_timeout_seconds: float = Field(
        2.0, gt=0, le=30, description="a KV client must finish TLS and the HMAC handshake within this"
    )
    kv_max_handshakes: int = Field(
        256, ge=1, description="KV connections not yet authenticated, from all sources (the oldest makes room)"
    )
    kv_max_handshakes_per_address: int = Field(
        32, ge=1, description="KV connections not yet authenticated from one address or IPv6 /64 (oldest makes room)"
    )
    kv_max_connections: int = Field(
        4096, ge=1, description="authenticated KV connections; beyond it a handshake is refused with `capacity`"
    )
    kv_drop_log_seconds: float = Field(
        10.0, gt=0, description="at most one log line per this many seconds about dropped KV connections"
    )


class Evictable(Protocol):
    def evict(self) -> None: ...


def source_of(peer: object) -> str:
    """The address a connection counts against: its IPv4 address, or the /64 of its IPv6 one."""
    host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_SOURCE_PREFIX), strict=False))
    return str(address)


class Slots:
    """The listener's connection slots (thread-safe): unauthenticated ones by source, oldest first, and a count of
    authenticated ones."""

    def __init__(self, limits: KVListenerSettings) -> None:
        self._limits = limits
        self._lock = threading.Lock()
        self._pending: dict[str, OrderedDict[Evictable, float]] = {}  # source -> links, oldest first: admitted at
        self._pending_total = 0
        self._authenticated: set[Evictable] = set()

    @property
    def pending(self) -> int:
        return self._pending_total

    @property
    def authenticated(self) -> int:
        return len(self._authenticated)

    def admit(self, link: Evictable, source: str) -> list[Evictable]:
        """Give `link` a slot before authentication; returns the connections that made room (to evict)."""
        with self._lock:
            evicted: list[Evictable] = []
            if len(self._pending.get(source, ())) >= self._limits.kv_max_handshakes_per_address:
                evicted.append(self._evict_oldest(source))
            if self._pending_total >= self._limits.kv_max_handshakes:
                evicted.append(self._evict_oldest(self._fullest_source()))
            self._pending.setdefault(source, OrderedDict())[link] = time.monotonic()
            self._pending_total += 1
            return evicted

    def has_room_to_authenticate(self) -> bool:
        return len(self._authenticated) < self._limits.kv_max_connections

    def authenticate(self, link: Evictable, source: str) -> None:
        """Move `link` from the unauthenticated slots to the authenticated ones; `capacity` if they are full, or
        `connection` if it was evicted meanwhile."""
        with self._lock:
            if not self.has_room_to_authenticate():
                raise KVTransferError("capacity", self.full_message())
            if not self._forget_pending(link, source):
                raise KVTransferError("connection", "evicted before it authenticated")
            self._authenticated.add(link)

    def leave(self, link: Evictable, source: str) -> None:
        with self._lock:
            self._forget_pending(link, source)
            self._authenticated.discard(link)

    def full_message(self) -> str:
        cap = self._limits.kv_max_connections
        return f"expected at most {cap} authenticated connections, got one more; retry later"

    def _evict_oldest(self, source: str) -> Evictable:
        links = self._pending[source]
        oldest, _ = links.popitem(last=False)
        if not links:
            del self._pending[source]
        self._pending_total -= 1
        return oldest

    def _fullest_source(self) -> str:
        """The source holding the most slots; of several, the one holding the oldest. (At most kv_max_handshakes
        sources: a scan per accept at the cap is cheap next to the accept itself.)"""

        def holding(source: str) -> tuple[int, float]:
            links = self._pending[source]
            return len(links), -next(iter(links.values()))

        return max(self._pending, key=holding)

    def _forget_pending(self, link: Evictable, source: str) -> bool:
        links = self._pending.get(source)
        if links is None or link not in links:
            return False
        del links[link]
        if not links:
            del self._pending[source]
        self._pending_total -= 1
        return True


class DropLog:
    """Counts what the listener drops (every drop, in KVMetrics) and logs it at most once per `interval_s`: the first
    drop at once, later ones summed into the next line due."""

    def __init__(self, metrics: KVMetrics, interval_s: float) -> None:
        self._metrics = metrics
        self._interval = interval_s
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._since = time.monotonic()
        self._next_line = 0.0  # monotonic time the next line may go out; 0: at once
        self.lines = 0  # lines logged so far (tests compare it with the counter)

    def note(self, reason: DropReason, source: str, detail: str) -> None:
        self._metrics.observe_dropped(reason)
        now = time.monotonic()
        with self._lock:
            self._counts[reason] += 1
            if now < self._next_line:
                return
            counts, since = self._counts, self._since
            self._counts, self._since, self._next_line = Counter(), now, now + self._interval
            self.lines += 1
        summary = ", ".join(f"{reason} {counts[reason]}" for reason in DROP_REASONS if counts[reason])
        log.warning(
            "kv: dropped %d connections before authentication in the last %.0f s (%s); the last from %s: %s",
            sum(counts.values()),
            now - since,
            summary,
            source,
            detail,
        )
