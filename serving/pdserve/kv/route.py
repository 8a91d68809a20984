"""One request and its reply (a pull stream, an ack) on a connection of its own or a pooled one, sent once more on a
new connection when a pooled one turns out to be stale."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.kv.connect import Connector
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics
from pdserve.kv.pool import KVConnection, KVConnectionPool, peer_key
from pdserve.kv.protocol import Frame, FrameType, json_payload
from pdserve.kv.wire import FrameSocket

T = TypeVar("T")


class StaleConnection(Exception):
    """A request's connection was lost before any reply came back."""

    def __init__(self, error: KVTransferError) -> None:
        super().__init__(error.message)
        self.error = error


def first_reply(channel: FrameSocket, frame_type: FrameType, body: dict[str, Any], timeout: float) -> Frame:
    """Send one request and read the first frame of its reply (KEEPALIVEs skipped)."""
    try:
        channel.send(timeout, frame_type, json_payload(body))
        return channel.read_reply(timeout)
    except KVTransferError as error:
        if error.cause == "connection":
            raise StaleConnection(error) from None
        raise


@dataclass(frozen=True)
class Route:
    """Where one pull or ack goes and how: the server, how to connect, the pool if any, and the metrics."""

    connector: Connector
    host: str
    port: int
    pool: KVConnectionPool | None
    metrics: KVMetrics

    async def open(self) -> KVConnection:
        if self.pool is not None:
            return await self.pool.acquire(self.connector, self.host, self.port)
        channel, session = await self.connector.connect_session(self.host, self.port)
        self.metrics.observe_connection("receiver", "new")
        return KVConnection(channel, peer_key(self.connector, self.host, self.port), session)

    def give_back(self, connection: KVConnection, *, clean: bool) -> None:
        if self.pool is not None:
            self.pool.release(connection, reusable=clean)
        else:
            connection.close()

    async def exchange(self, work: Callable[..., T], *args: Any) -> T:
        """Run `work(connection, *args)` (a request and its reply) on a stream thread, on a connection the route opens
        and takes back: to the pool only if `work` returned.

        A pooled connection the server closed while it sat idle (idle timeout, restart) can look open until it is
        used; it then fails with a lost connection before the first reply frame (`StaleConnection`). The request is
        then sent once more on a new connection. That is safe because nothing of the reply was used: a PULL changes
        nothing on the server (the lease stays held until ACK), and a repeated ACK can at worst answer released=False
        for a lease the first one freed.
        """
        connection = await self.open()
        connection.channel.stall_timeout_s = self.connector.stall_bound_s  # a pooled one: this caller's
        clean = False
        try:
            while True:
                try:
                    result = await connection.run(work, *args)
                except StaleConnection as stale:
                    if self.pool is None or not connection.reused:
                        raise stale.error from None
                    connection = await self.pool.replace_stale(connection, self.connector, self.host, self.port)
                    continue
                clean = True
                return result
        finally:
            self.give_back(connection, clean=clean)
