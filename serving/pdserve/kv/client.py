"""The decode side of the KV channel: pull a blob over N parallel streams, verify it, then acknowledge it.

`pull` and `ack` are coroutines, but each stream runs on its own thread with a blocking socket (pdserve.kv.wire):
DATA lands by recv_into straight in the destination array, its CRC-32C is checked there, and each digest unit is
hashed (BLAKE3) on a verify thread as soon as its last byte is in; the socket calls and hashes release the GIL, so
streams use as many cores as there are. The event loop only starts the streams and waits for them.

Pulls and acks can borrow authenticated connections from a KVConnectionPool, so a decode server that pulls from the
same prefill server again skips the TCP and HMAC handshakes and finds TCP's window already open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import propagate

from pdserve.kv import auth
from pdserve.kv.blob import (
    DIGEST_BYTES,
    KVBlob,
    Layer,
    Manifest,
    blob_checksum,
    flat_views,
    unit_digests,
)
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.protocol import (
    DATA_HEADER,
    MAX_CONTROL_PAYLOAD,
    NONCE_BYTES,
    PROOF_BYTES,
    Chunk,
    Frame,
    FrameType,
    chunk_plan,
    expect,
    json_payload,
)
from pdserve.kv.recv import destination_arrays
from pdserve.kv.wire import FrameSocket

T = TypeVar("T")
STREAM_THREADS = 256  # stream and connect threads, over all pulls of the process
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _threads(name: str, workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"pdstack-kv-{name}")
        return _pools[name]


def _stream_threads() -> ThreadPoolExecutor:
    return _threads("stream", STREAM_THREADS)


def _verify_threads() -> ThreadPoolExecutor:
    return _threads("verify", os.cpu_count() or 2)


@dataclass(frozen=True)
class Connector:
    """How to reach a prefill server's KV port: key, TLS, timeouts and connect retries."""

    key: auth.SecretKey
    ssl_context: ssl.SSLContext | None = None
    server_hostname: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.2

    async def connect(self, host: str, port: int) -> FrameSocket:
        """Open an authenticated connection (see `connect_session`)."""
        channel, _session = await self.connect_session(host, port)
        return channel

    async def connect_session(self, host: str, port: int) -> tuple[FrameSocket, bytes]:
        """Open an authenticated connection (on a thread) and return it with its session key, retrying refused or
        timed-out connects with exponential backoff."""
        for attempt in range(self.retries + 1):
            future = _stream_threads().submit(self.connect_blocking, host, port)
            try:
                return await asyncio.wrap_future(future)
            except KVTransferError as error:
                if error.cause not in ("connection", "timeout") or attempt == self.retries:
                    raise
            except asyncio.CancelledError:
                future.add_done_callback(_close_unused)
                raise
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def connect_blocking(self, host: str, port: int) -> tuple[FrameSocket, bytes]:
        """One connect, TLS and HMAC handshake, on the calling thread."""
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except TimeoutError as error:
            raise KVTransferError(
                "timeout", f"connect to {host}:{port} took over {self.connect_timeout_s:g} s"
            ) from error
        except OSError as error:
            raise KVTransferError(
                "connection", f"cannot connect to {host}:{port}: {error.strerror or error}"
            ) from error
        channel = FrameSocket(sock)
        try:
            if self.ssl_context is not None:
                channel = FrameSocket(self._wrap(sock, host, port))
            return channel, self._handshake(channel)
        except BaseException:
            channel.close()
            sock.close()
            raise

    def _wrap(self, sock: socket.socket, host: str, port: int) -> ssl.SSLSocket:
        assert self.ssl_context is not None
        try:
            # As asyncio did before (3594ff4): the name to verify defaults to the host connected to.
            return self.ssl_context.wrap_socket(sock, server_hostname=self.server_hostname or host)
        except ssl.SSLError as error:
            raise KVTransferError("auth", f"TLS handshake with {host}:{port} failed: {error.reason}") from error
        except TimeoutError as error:
            raise KVTransferError(
                "timeout", f"TLS handshake with {host}:{port} took over {self.connect_timeout_s:g} s"
            ) from error
        except OSError as error:
            raise KVTransferError("connection", f"TLS handshake with {host}:{port} failed: {error!r}") from error

    def _handshake(self, channel: FrameSocket) -> bytes:
        client_nonce = auth.new_nonce()
        channel.send(self.read_timeout_s, FrameType.HELLO, client_nonce)
        challenge = expect(channel.read_frame(self.read_timeout_s), FrameType.CHALLENGE).payload
        if len(challenge) != NONCE_BYTES + PROOF_BYTES:
            raise KVTransferError(
                "auth",
                f"expected CHALLENGE ({NONCE_BYTES}-byte nonce and {PROOF_BYTES}-byte "
                f"proof), got CHALLENGE ({len(challenge)} bytes)",
            )
        server_nonce, proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
        auth.verify(auth.server_proof(self.key, client_nonce, server_nonce), proof, "server")
        # The AUTH frame is not answered; the request that follows it is, which saves a round trip.
        channel.send(self.read_timeout_s, FrameType.AUTH, auth.client_proof(self.key, client_nonce, server_nonce))
        return auth.session_key(self.key, client_nonce, server_nonce)


def _close_unused(future: Future[tuple[FrameSocket, bytes]]) -> None:
    """A connect whose caller was cancelled: close what it opened."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()


class _Assembly:
    """Destination arrays for one pull from row `first_row` on, filled by the stream threads; hashes each digest unit
    on a verify thread as soon as its last byte lands, and checks them against the announced ones at the end."""

    def __init__(self, manifest: Manifest, first_row: int) -> None:
        self.manifest = manifest
        self.units = manifest.units
        self.plan = chunk_plan(manifest, first_row)
        arrays = destination_arrays([(spec.shape, spec.dtype) for pair in manifest.layers for spec in pair])
        self.layers: list[Layer] = [(arrays[i], arrays[i + 1]) for i in range(0, len(arrays), 2)]
        self._views = flat_views(self.layers)
        self._lock = threading.Lock()
        self._expected = {(chunk.layer, chunk.part, chunk.offset): chunk for chunk in self.plan}
        self._missing: dict[int, int] = {}  # unit -> bytes of it still to come
        for chunk in self.plan:
            for unit, overlap in self._overlaps(chunk):
                self._missing[unit] = self._missing.get(unit, 0) + overlap
        self._hashes: list[Future[list[bytes]]] = []
        self._hashed: list[list[int]] = []

    def _overlaps(self, chunk: Chunk) -> list[tuple[int, int]]:
        array, end = 2 * chunk.layer + chunk.part, chunk.offset + chunk.length
        overlaps = []
        for unit in self.units.covering(array, chunk.offset, end):
            _array, start, stop = self.units.span(unit)
            overlaps.append((unit, min(stop, end) - max(start, chunk.offset)))
        return overlaps

    def target(self, layer: int, part: int, offset: int, length: int) -> tuple[Chunk, memoryview]:
        """Where a DATA payload goes, if it is a chunk of the plan no stream has received yet (it then counts as
        received): the chunk and the slice of its destination array."""
        with self._lock:
            chunk = self._expected.pop((layer, part, offset), None)
        if chunk is None or chunk.length != length:
            raise KVTransferError(
                "protocol",
                f"got chunk (layer {layer}, part {part}, offset {offset}, {length} bytes), which this pull was not "
                "to receive (or received twice)",
            )
        return chunk, self._views[2 * layer + part][offset : offset + length]

    @property
    def chunks_missing(self) -> int:
        with self._lock:
            return len(self._expected)

    def landed(self, chunk: Chunk) -> None:
        """A chunk's bytes are in place (and passed their frame CRC): hash every unit it completed."""
        complete = []
        with self._lock:
            for unit, overlap in self._overlaps(chunk):
                self._missing[unit] -= overlap
                if self._missing[unit] == 0:
                    complete.append(unit)
            if complete:
                self._hashes.append(_verify_threads().submit(unit_digests, self._views, self.units, complete))
                self._hashed.append(complete)

    def receive(self, channel: FrameSocket, timeout: float) -> Frame | None:
        """Read the next frame that is not a KEEPALIVE: DATA goes straight into its destination, its CRC checked
        there (None is returned); any other frame is returned, CRC checked."""
        data_max = DATA_HEADER.size + self.manifest.chunk_bytes
        digests = self.units.total * DIGEST_BYTES
        while True:
            header, deadline = channel.read_header(timeout, max(data_max, digests, MAX_CONTROL_PAYLOAD))
            if header.type is FrameType.DATA and DATA_HEADER.size <= header.length <= data_max:
                sub = channel.recv_bytes(DATA_HEADER.size, deadline, timeout)
                layer, part, offset = DATA_HEADER.unpack(sub)
                chunk, view = self.target(layer, part, offset, header.length - DATA_HEADER.size)
                channel.recv_into(view, deadline, timeout)
                header.check_crc(sub, view)
                self.landed(chunk)
                return None
            if header.type is FrameType.DATA:
                raise KVTransferError(
                    "protocol",
                    f"a DATA frame carries {DATA_HEADER.size} to {data_max} bytes here, "
                    f"its header claims {header.length}",
                )
            limit = digests if header.type is FrameType.DIGESTS else MAX_CONTROL_PAYLOAD
            if header.length > limit:
                raise KVTransferError(
                    "protocol",
                    f"a {header.type.name} frame here carries at most {limit} bytes, its header claims {header.length}",
                )
            payload = channel.recv_bytes(header.length, deadline, timeout)
            header.check_crc(payload)
            if header.type is not FrameType.KEEPALIVE:
                return Frame(header.type, payload)

    async def verify(self, digests: bytes, checksum: str) -> None:
        """The announced unit digests hash to the announced checksum, and every unit received has its digest."""
        if len(digests) != self.units.total * DIGEST_BYTES:
            raise KVTransferError(
                "protocol", f"DIGESTS carries {len(digests)} bytes, expected {self.units.total * DIGEST_BYTES}"
            )
        manifest = self.manifest
        if blob_checksum(manifest.meta, manifest.layers, manifest.unit_rows, digests) != checksum:
            raise KVTransferError("checksum", "the announced unit digests do not match the blob checksum")
        if self.chunks_missing or any(self._missing.values()):
            raise KVTransferError("protocol", f"transfer ended with {self.chunks_missing} chunks not received")
        computed = await asyncio.gather(*(asyncio.wrap_future(future) for future in self._hashes))
        for units, digests_of in zip(self._hashed, computed, strict=True):
            for unit, digest in zip(units, digests_of, strict=True):
                if digest != digests[unit * DIGEST_BYTES : (unit + 1) * DIGEST_BYTES]:
                    array, start, _end = self.units.span(unit)
                    raise KVTransferError(
                        "checksum", f"layer {array // 2} {'KV'[array % 2]} bytes from {start} do not match their digest"
                    )


@dataclass
class _Pull:
    request_id: str
    expected_checksum: str | None
    expected_fingerprint: str | None
    streams: int
    first_row: int = 0
    pull_id: str = field(default_factory=lambda: secrets.token_hex(16))  # the server shares chunks by it
    trace: dict[str, str] = field(default_factory=dict)  # the caller's traceparent, outside the END MAC
    assembly: _Assembly | None = None
    manifest_bytes: bytes | None = None
    announced: str | None = None  # the checksum END announced
    digests: bytes | None = None  # the unit digests stream 0 received
    lock: threading.Lock = field(default_factory=threading.Lock)  # the stream threads share this state

    def end_checksum(self, checksum: object) -> None:
        """Every stream's END must announce the same checksum (the one expected, when the caller knows it)."""
        if not isinstance(checksum, str) or not checksum:
            raise KVTransferError("protocol", "END carries no blob checksum")
        if self.expected_checksum is not None and checksum != self.expected_checksum:
            raise KVTransferError("checksum", "the prefill server's END announces a different checksum")
        with self.lock:
            self._agree(checksum)

    def _agree(self, checksum: str) -> None:
        if self.announced is not None and checksum != self.announced:
            raise KVTransferError("protocol", "streams of one pull ended with different checksums")
        self.announced = checksum

    def assembly_for(self, manifest_bytes: bytes) -> _Assembly:
        """The shared destination, created by whichever stream's manifest arrives first; all must agree."""
        with self.lock:
            return self._assembly_for(manifest_bytes)

    def _assembly_for(self, manifest_bytes: bytes) -> _Assembly:
        try:
            manifest = Manifest.from_bytes(manifest_bytes)
        except (ValueError, KeyError, TypeError) as error:
            raise KVTransferError("protocol", f"malformed manifest: {error}") from error
        if self.assembly is not None:
            # A stream whose PULL came after prefill sealed a streamed blob sees its checksum, the others an empty
            # one; everything else must agree (END's MAC covers each stream's manifest and END's checksum).
            if dataclasses.replace(manifest, checksum="") != dataclasses.replace(self.assembly.manifest, checksum=""):
                raise KVTransferError("protocol", "streams of one pull received different manifests")
            return self.assembly
        self._check(manifest)
        try:
            assembly = _Assembly(manifest, self.first_row)
        except ValueError as error:
            raise KVTransferError("protocol", f"cannot pull from row {self.first_row}: {error}") from error
        self.manifest_bytes = manifest_bytes
        self.assembly = assembly
        return self.assembly

    def _check(self, manifest: Manifest) -> None:
        if manifest.meta.request_id != self.request_id:
            raise KVTransferError("protocol", f"asked for {self.request_id!r}, got {manifest.meta.request_id!r}")
        if self.expected_fingerprint is not None and manifest.meta.fingerprint != self.expected_fingerprint:
            raise KVTransferError(
                "fingerprint",
                f"KV fingerprint {manifest.meta.fingerprint!r} does not match this decoder's "
                f"{self.expected_fingerprint!r}",
            )
        # A blob still being computed has no checksum yet (its END carries it).
        if manifest.checksum and self.expected_checksum is not None and manifest.checksum != self.expected_checksum:
            raise KVTransferError("checksum", "the prefill server's manifest announces a different checksum")


# Who a connection was authenticated with: address, TLS server name, key and TLS context (the last two by identity),
# so a pooled connection is never handed to a caller with other credentials.
PeerKey = tuple[str, int, str | None, auth.SecretKey, ssl.SSLContext | None]


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
        return await asyncio.wrap_future(_stream_threads().submit(self._run, work, *args))

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


class _Stale(Exception):
    """A request's connection was lost before any reply came back."""

    def __init__(self, error: KVTransferError) -> None:
        super().__init__(error.message)
        self.error = error


def _trace_context() -> dict[str, str]:
    """The W3C traceparent of the caller's current span (nothing when there is none, e.g. tracing off), so that the
    server's side of the pull joins the caller's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {"traceparent": carrier["traceparent"]} if "traceparent" in carrier else {}


def _first_reply(channel: FrameSocket, frame_type: FrameType, body: dict[str, Any], timeout: float) -> Frame:
    """Send one request and read the first frame of its reply (KEEPALIVEs skipped)."""
    try:
        channel.send(timeout, frame_type, json_payload(body))
        return channel.read_reply(timeout)
    except KVTransferError as error:
        if error.cause == "connection":
            raise _Stale(error) from None
        raise


def peer_key(connector: Connector, host: str, port: int) -> PeerKey:
    return (host, port, connector.server_hostname if connector.ssl_context else None, connector.key,
            connector.ssl_context)  # fmt: skip


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


@dataclass(frozen=True)
class _Route:
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
        used; it then fails with a lost connection before the first reply frame (`_Stale`). The request is then sent
        once more on a new connection. That is safe because nothing of the reply was used: a PULL changes nothing on
        the server (the lease stays held until ACK), and a repeated ACK can at worst answer released=False for a
        lease the first one freed.
        """
        connection = await self.open()
        clean = False
        try:
            while True:
                try:
                    result = await connection.run(work, *args)
                except _Stale as stale:
                    if self.pool is None or not connection.reused:
                        raise stale.error from None
                    connection = await self.pool.replace_stale(connection, self.connector, self.host, self.port)
                    continue
                clean = True
                return result
        finally:
            self.give_back(connection, clean=clean)


async def pull(
    host: str,
    port: int,
    request_id: str,
    expected_checksum: str | None,
    *,
    key: auth.SecretKey,
    streams: int = 4,
    expected_fingerprint: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 10.0,
    retries: int = 2,
    backoff_s: float = 0.2,
    metrics: KVMetrics | None = None,
    pool: KVConnectionPool | None = None,
    first_row: int = 0,
) -> KVBlob:
    """Pull the KV of `request_id`, verify every frame and the whole blob, and return it (the lease stays held).

    `expected_checksum` is the one prefill's signed params announced; None for a pull started before prefill ended
    (early dispatch): the blob must then match the checksum the authenticated server announces at END, and the
    caller checks the manifest's token count.

    With `first_row` > 0 only leading rows (blocks) from that one on are sent (decode has the others); every unit
    sent is verified against the digests that make up the blob checksum.

    With a `pool`, each stream borrows a connection from it (the pool's metrics count those connections) and gives
    it back after a clean END; without one, each stream opens and closes its own.
    """
    if streams < 1:
        raise ValueError(f"streams: must be at least 1, got {streams}")
    if first_row < 0:
        raise ValueError(f"first_row: must be at least 0, got {first_row}")
    connector = Connector(key, ssl_context, server_hostname, connect_timeout_s, read_timeout_s, retries, backoff_s)
    recorder = metrics if metrics is not None else default_metrics()
    state = _Pull(request_id, expected_checksum, expected_fingerprint, streams, first_row, trace=_trace_context())
    started = time.perf_counter()
    try:
        await _run_streams(_Route(connector, host, port, pool, recorder), state)
        assert state.assembly is not None and state.announced is not None
        if state.digests is None:
            raise KVTransferError("protocol", "no stream received the unit digests")
        await state.assembly.verify(state.digests, state.announced)
    except KVTransferError as error:
        recorder.observe_failure("receiver", error.cause)
        raise
    blob = KVBlob(state.assembly.manifest.meta, state.assembly.layers, first_row)
    received = sum(chunk.length for chunk in state.assembly.plan)
    recorder.observe_transfer("receiver", received, time.perf_counter() - started)
    return blob


async def _run_streams(route: _Route, state: _Pull) -> None:
    tasks = [asyncio.create_task(_pull_stream(route, state, index)) for index in range(state.streams)]
    try:
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled: each stream's connection is aborted as its task ends
        for task in tasks:
            task.cancel()
        raise
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    failed = [task.exception() for task in tasks if task.done() and not task.cancelled() and task.exception()]
    if failed:
        raise failed[0]  # type: ignore[misc]


async def _pull_stream(route: _Route, state: _Pull, index: int) -> None:
    request = {"request_id": state.request_id, "pull": state.pull_id, "stream": index, "streams": state.streams,
               "first_row": state.first_row}  # fmt: skip
    await route.exchange(_receive_stream, state, request, route.connector.read_timeout_s)


def _receive_stream(connection: KVConnection, state: _Pull, request: dict[str, Any], timeout: float) -> None:
    """One stream of a pull, on its thread: PULL, MANIFEST, the DATA chunks the server gives this stream, (DIGESTS,)
    END."""
    channel = connection.channel
    index = int(request["stream"])
    manifest = expect(
        _first_reply(channel, FrameType.PULL, {**request, **state.trace}, timeout), FrameType.MANIFEST
    ).payload
    assembly = state.assembly_for(manifest)
    chunks = 0
    while (frame := assembly.receive(channel, timeout)) is None or frame.type is FrameType.DIGESTS:
        if frame is None:
            chunks += 1
        elif index != 0 or state.digests is not None:
            raise KVTransferError("protocol", f"stream {index} got an unexpected DIGESTS frame")
        else:
            state.digests = frame.payload
    end = expect(frame, FrameType.END).json()
    if index == 0 and state.digests is None:
        raise KVTransferError("protocol", "stream 0 ended without DIGESTS")
    if end.get("chunks") != chunks:
        raise KVTransferError(
            "protocol", f"stream {index} ended announcing {end.get('chunks')} chunks, it got {chunks}"
        )
    _check_end_mac(connection.session, manifest, request, end, chunks)
    announced = Manifest.from_bytes(manifest).checksum
    if announced and announced != end.get("checksum"):
        raise KVTransferError("protocol", f"stream {index}'s manifest and END announce different checksums")
    state.end_checksum(end.get("checksum"))


def _check_end_mac(session: bytes, manifest: bytes, request: dict[str, Any], end: dict[str, Any], chunks: int) -> None:
    """END's MAC must be the server's, under this connection's session key, over what this stream received."""
    checksum, mac = end.get("checksum"), end.get("mac")
    if not isinstance(checksum, str) or not isinstance(mac, str):
        raise KVTransferError("protocol", "END needs checksum and mac (strings)")
    expected = auth.end_mac(session, manifest, request, checksum, chunks)
    if not hmac.compare_digest(expected, mac):
        raise KVTransferError(
            "auth",
            "END's MAC does not match: the manifest or blob checksum was not sent by the "
            "authenticated server (rewritten on the path?)",
        )


async def ack(
    host: str,
    port: int,
    request_id: str,
    *,
    key: auth.SecretKey,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 10.0,
    retries: int = 2,
    metrics: KVMetrics | None = None,
    pool: KVConnectionPool | None = None,
) -> bool:
    """Tell prefill the KV arrived so it frees the lease; True if the server still held it."""
    connector = Connector(key, ssl_context, server_hostname, connect_timeout_s, read_timeout_s, retries)
    route = _Route(connector, host, port, pool, metrics if metrics is not None else default_metrics())
    return await route.exchange(_send_ack, request_id, read_timeout_s)


def _send_ack(connection: KVConnection, request_id: str, timeout: float) -> bool:
    reply = _first_reply(connection.channel, FrameType.ACK, {"request_id": request_id}, timeout)
    return bool(expect(reply, FrameType.ACK_OK).json().get("released"))
