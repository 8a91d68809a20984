"""Authenticated connections to KV servers (`KVConnection`) and the pool that keeps idle ones for the next pull
stream or ack to the same server (`KVConnectionPool`): a decode server that pulls from the same prefill server again
skips the TCP and HMAC handshakes and finds TCP's window already open."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pdserve.common.kv_tls import SocketWrapper
from pdserve.kv import auth
from pdserve.kv.connect import Connector
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.threads import stream_threads
from pdserve.kv.wire import FrameSocket

T = TypeVar("T")

# Who a connection was authenticated with: address, TLS server name, key and TLS context (the last two by identity),
# so a pooled connection is never handed to a caller with other credentials.
PeerKey = tuple[str, int, str | None, auth.SecretKey, SocketWrapper | None]


@dataclass(eq=False)
class KVConnection:
    """One authenticated connection to a KV server; `reused` is True when it came out of a pool's idle set.

    While a stream thread works on it (`run`), `close` only aborts it (wakes the thread); the thread closes it when
    it is done, so the socket's descriptor is never closed under a call still running on it."""

    channel: FrameSocket
    peer: PeerKey
    session: bytes  # the key the server MACs END under (pdserve.kv.auth.session_key)
    reused: bool = False
    idle_since: float = 0.0
    _busy: bool = False
    _close_when_done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def closed(self) -> bool:
        return self.channel.closed or self._close_when_done

    @property
    def closed_by_peer(self) -> bool:
        """The peer closed or reset it, or sent something unasked (as far as this side can see), or it was closed
        here."""
        return self.closed or self.channel.readable_now()

    def close(self) -> None:
        with self._lock:
            if self._busy:
                self._close_when_done = True
                self.channel.abort()
                return
        self.channel.close()

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(self, *args)` on a stream thread."""
        return await asyncio.wrap_future(stream_threads().submit(self._run, work, *args))

    def _run(self, work: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._close_when_done:
                raise KVTransferError("connection", "the KV connection was closed")
            self._busy = True
        try:
            return work(self, *args)
        finally:
            with self._lock:
                self._busy = False
                closing = self._close_when_done
            if closing:
                self.channel.close()


def peer_key(connector: Connector, host: str, port: int) -> PeerKey:
    return (
        host,
        port,
        connector.server_hostname if connector.ssl_context else None,
        connector.key,
        connector.ssl_context,
    )


class KVConnectionPool:
    """Idle authenticated connections to KV servers, kept for the next pull stream or ack to the same server.

    A connection is either idle here or held by exactly one stream. It comes back only after its request ended
    cleanly (END or ACK_OK read); after anything else it is closed. Idle connections are closed after
    `idle_timeout_s`, which should stay below the server's idle timeout (KVServer's idle_timeout_s, 300 s by default)
    so the client, not the server, usually ends them. At most `max_idle_per_peer` are kept per server.

    `metrics` counts the connections this pool hands out: new, reused, or stale (a pooled connection the server had
    closed, replaced by a fresh one).
    """

    def __init__(
        self,
        *,
        max_idle_per_peer: int = 16,
        idle_timeout_s: float = 60.0,
        metrics: KVMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_idle_per_peer < 1:
            raise ValueError(f"max_idle_per_peer: must be at least 1, got {max_idle_per_peer}")
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s: must be positive, got {idle_timeout_s}")
        self.max_idle_per_peer = max_idle_per_peer
        self.idle_timeout_s = idle_timeout_s
        self._metrics = metrics if metrics is not None else default_metrics()
        self._clock = clock
        self._idle: dict[PeerKey, list[KVConnection]] = {}
        self._lent: set[KVConnection] = set()
        self._closed = False

    def __len__(self) -> int:
        """Idle connections held, over all servers."""
        return sum(len(idle) for idle in self._idle.values())

    async def acquire(self, connector: Connector, host: str, port: int) -> KVConnection:
        """The most recently returned idle connection to this server that is still open, or a new one."""
        self._check_open()
        self._expire()
        idle = self._idle.get(peer_key(connector, host, port), [])
        while idle:
            connection = idle.pop()
            if connection.closed_by_peer:
                self._count("stale")
                connection.close()
                continue
            connection.reused = True
            self._lent.add(connection)
            self._count("reused")
            return connection
        return await self._connect(connector, host, port)

    async def replace_stale(self, stale: KVConnection, connector: Connector, host: str, port: int) -> KVConnection:
        """A new connection in place of a pooled one the server had closed; its other idle ones go too."""
        self.release(stale, reusable=False)
        self._count("stale")
        for connection in self._idle.pop(stale.peer, []):
            connection.close()
        self._check_open()
        return await self._connect(connector, host, port)

    def release(self, connection: KVConnection, *, reusable: bool) -> None:
        """Take back a borrowed connection: kept if `reusable` (its request ended cleanly) and there is room."""
        self._lent.discard(connection)
        idle = self._idle.get(connection.peer, [])
        if not reusable or self._closed or connection.closed_by_peer or len(idle) >= self.max_idle_per_peer:
            connection.close()
            return
        connection.idle_since = self._clock()
        self._idle[connection.peer] = [*idle, connection]
        self._expire()

    async def close(self) -> None:
        """Close every connection, idle or borrowed (a borrowed one's request then fails); later acquires fail."""
        self._closed = True
        connections = [*self._lent, *(c for idle in self._idle.values() for c in idle)]
        self._idle.clear()
        self._lent.clear()
        for connection in connections:
            connection.close()

    async def _connect(self, connector: Connector, host: str, port: int) -> KVConnection:
        channel, session = await connector.connect_session(host, port)
        connection = KVConnection(channel, peer_key(connector, host, port), session)
        if self._closed:  # closed while this connect was under way
            connection.close()
            self._check_open()
        self._lent.add(connection)
        self._count("new")
        return connection

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError("connection", "the KV connection pool is closed")

    def _expire(self) -> None:
        """Close connections idle for longer than idle_timeout_s, for every server."""
        oldest = self._clock() - self.idle_timeout_s
        for peer, idle in list(self._idle.items()):
            for connection in idle:
                if connection.idle_since <= oldest:
                    connection.close()
            keep = [connection for connection in idle if connection.idle_since > oldest]
            if keep:
                self._idle[peer] = keep
            else:
                del self._idle[peer]

    def _count(self, outcome: str) -> None:
        self._metrics.observe_connection("receiver", outcome)
