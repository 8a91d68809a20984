"""The KV channel's listener, run inside the prefill server's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl
import time

from pdserve.kv import auth
from pdserve.kv.blob import as_bytes
from pdserve.kv.entry import StoredKV, Watch
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.protocol import (
    DATA_HEADER,
    MAX_HANDSHAKE_PAYLOAD,
    MAX_REQUEST_PAYLOAD,
    NONCE_BYTES,
    PROOF_BYTES,
    Chunk,
    Frame,
    FrameType,
    chunk_plan,
    expect,
    read_frame,
    write_error,
    write_frame,
    write_json,
)
from pdserve.kv.store import LeaseStore

log = logging.getLogger(__name__)
MAX_STREAMS = 64
READ_BUFFER_BYTES = 64 << 10  # asyncio's StreamReader buffer per connection (pauses reading beyond twice this)


class KVServer:
    """Serves pulls and acks for the blobs in a LeaseStore over authenticated (optionally TLS) TCP connections."""

    def __init__(
        self,
        store: LeaseStore,
        key: auth.SecretKey,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        io_timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        handshake_timeout_s: float = 10.0,
        max_handshakes: int = 256,
        metrics: KVMetrics | None = None,
        tcp_congestion: str | None = None,
        open_wait_s: float = 0.0,
        keepalive_s: float = 1.0,
    ) -> None:
        """`handshake_timeout_s` bounds the whole handshake (HELLO to AUTH); at most `max_handshakes` connections
        may be authenticating at once (more are refused at once), so unauthenticated clients hold little.

        A pull of an id not held yet waits up to `open_wait_s` for prefill to open it (early dispatch: decode may
        ask first), then fails `not_found`; while a pull waits it gets a KEEPALIVE every `keepalive_s`."""
        self.store = store
        self._key = key
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._io_timeout = io_timeout_s
        self._idle_timeout = idle_timeout_s
        self._handshake_timeout = handshake_timeout_s
        self._max_handshakes = max_handshakes
        self._handshakes = 0
        self._metrics = metrics if metrics is not None else default_metrics()
        self._tcp_congestion = tcp_congestion
        self._open_wait = open_wait_s
        self._keepalive = keepalive_s
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("KVServer is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connection, self._host, self._port, ssl=self._ssl,
                                                  limit=READ_BUFFER_BYTES)
        if self._tcp_congestion is not None:
            self._set_congestion_control(self._tcp_congestion)

    def _set_congestion_control(self, name: str) -> None:
        """Pick the sender's TCP congestion control; accepted connections inherit it from the listener (Linux)."""
        assert self._server is not None
        for listener in self._server.sockets:
            try:
                listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            except OSError as error:
                self._server.close()
                raise ValueError(f"tcp_congestion: the kernel refuses {name!r} ({error.strerror})") from error

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            # Aborting the sockets (rather than cancelling the handlers) lets each handler end on its own error path.
            for writer in self._connections.values():
                writer.transport.abort()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            await self._serve_connection(reader, writer)
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            session = await self._bounded_handshake(reader, writer)
        except KVTransferError as error:
            self._metrics.observe_auth_refused()
            log.warning("kv: refused connection from %s: %s", peer, error.message)
            await self._send_error(writer, error)
            return
        # One authenticated connection serves any number of requests, one after another, until the client closes
        # it, it idles out, or a request fails (the connection is then in no known state, so it is closed).
        for served in itertools.count():
            try:
                frame = await read_frame(reader, self._idle_timeout, MAX_REQUEST_PAYLOAD)
            except KVTransferError as error:
                if error.cause in ("connection", "timeout"):
                    return  # the client closed or went idle between requests
                self._metrics.observe_failure("sender", error.cause)
                log.info("kv: bad request frame from %s: %s", peer, error)
                await self._send_error(writer, error)
                return
            self._metrics.connections.labels("sender", "reused" if served else "new").inc()
            try:
                await self._dispatch(frame, writer, session)
            except KVTransferError as error:
                self._metrics.observe_failure("sender", error.cause)
                log.info("kv: request from %s failed: %s", peer, error)
                await self._send_error(writer, error)
                return

    async def _bounded_handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        """Authenticate the client; return the session key END frames are MACed under."""
        if self._handshakes >= self._max_handshakes:
            raise KVTransferError("capacity", f"expected at most {self._max_handshakes} connections authenticating "
                                  "at once, got one more; retry later")
        self._handshakes += 1
        try:
            async with asyncio.timeout(self._handshake_timeout):
                return await self._authenticate(reader, writer)
        except TimeoutError as error:
            raise KVTransferError("auth", f"expected HELLO then AUTH within {self._handshake_timeout:g} s, the "
                                  "handshake took longer") from error
        finally:
            self._handshakes -= 1

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        hello = await self._handshake_frame(reader, FrameType.HELLO, NONCE_BYTES, "nonce")
        server_nonce = auth.new_nonce()
        write_frame(
            writer, FrameType.CHALLENGE, server_nonce + auth.server_proof(self._key, hello.payload, server_nonce)
        )
        await self._drain(writer)
        proof = await self._handshake_frame(reader, FrameType.AUTH, PROOF_BYTES, "proof")
        auth.verify(auth.client_proof(self._key, hello.payload, server_nonce), proof.payload, "client")
        return auth.session_key(self._key, hello.payload, server_nonce)

    async def _handshake_frame(self, reader: asyncio.StreamReader, wanted: FrameType, size: int,
                               what: str) -> Frame:
        """One handshake frame, read only if its header claims at most MAX_HANDSHAKE_PAYLOAD bytes."""
        expected = f"{wanted.name} ({size}-byte {what})"
        try:
            frame = await read_frame(reader, self._io_timeout, MAX_HANDSHAKE_PAYLOAD)
        except KVTransferError as error:
            raise KVTransferError("auth", f"expected {expected}, got no valid frame: {error.message}") from None
        if frame.type is not wanted or len(frame.payload) != size:
            raise KVTransferError("auth", f"expected {expected}, got {frame.type.name} ({len(frame.payload)} bytes)")
        return frame

    async def _dispatch(self, frame: Frame, writer: asyncio.StreamWriter, session: bytes) -> None:
        if frame.type is FrameType.PULL:
            await self._serve_pull(frame, writer, session)
        elif frame.type is FrameType.ACK:
            request_id = str(expect(frame, FrameType.ACK).json().get("request_id", ""))
            released = self.store.ack(request_id)
            write_json(writer, FrameType.ACK_OK, {"request_id": request_id, "released": released})
            await self._drain(writer)
        else:
            raise KVTransferError("protocol", f"unexpected {frame.type.name} frame")

    async def _serve_pull(self, frame: Frame, writer: asyncio.StreamWriter, session: bytes) -> None:
        body = frame.json()
        request_id, stream, streams = body.get("request_id"), body.get("stream"), body.get("streams")
        first_row = body.get("first_row", 0)
        if not isinstance(request_id, str) or not isinstance(stream, int) or not isinstance(streams, int) \
                or not isinstance(first_row, int):
            raise KVTransferError("protocol", "PULL needs request_id (string), stream, streams and first_row "
                                  "(integers)")
        if not 1 <= streams <= MAX_STREAMS or not 0 <= stream < streams or first_row < 0:
            raise KVTransferError("protocol", f"PULL stream {stream} of {streams} from row {first_row} is out of range")
        stored = await self._wait_open(request_id, writer)
        started = time.perf_counter()
        manifest = stored.manifest.to_bytes()
        write_frame(writer, FrameType.MANIFEST, manifest)
        try:
            plan = chunk_plan(stored.manifest, first_row)
        except ValueError as error:
            raise KVTransferError("protocol", f"PULL first_row: {error}") from None
        chunks = plan[stream::streams]
        sent = await self._send_chunks(stored, chunks, writer)
        with stored.watch() as changed:
            while not stored.checksum:  # sealed and hashed
                await self._wait_change(stored, changed, writer)
        if stream == 0:
            write_frame(writer, FrameType.DIGESTS, stored.digests)
        request = {"request_id": request_id, "stream": stream, "streams": streams, "first_row": first_row}
        mac = auth.end_mac(session, manifest, request, stored.checksum, len(chunks))
        write_json(writer, FrameType.END, {"chunks": len(chunks), "bytes": sent, "checksum": stored.checksum,
                                           "mac": mac})
        await self._drain(writer)
        self._metrics.observe_transfer("sender", sent, time.perf_counter() - started)

    async def _wait_open(self, request_id: str, writer: asyncio.StreamWriter) -> StoredKV:
        """The blob of `request_id`, waiting up to open_wait_s for prefill to open it (then `not_found`)."""
        deadline = time.monotonic() + self._open_wait
        with self.store.watch() as opened:
            while True:
                try:
                    return self.store.get(request_id)
                except KVTransferError as error:
                    if error.cause != "not_found" or self.store.gone(request_id) or time.monotonic() >= deadline:
                        raise
                if not await opened.wait(min(self._keepalive, max(0.0, deadline - time.monotonic()))):
                    write_frame(writer, FrameType.KEEPALIVE)
                    await self._drain(writer)

    async def _send_chunks(self, stored: StoredKV, chunks: list[Chunk], writer: asyncio.StreamWriter) -> int:
        """Send each chunk as soon as prefill has added its bytes; return the bytes sent."""
        pending, sent = list(chunks), 0
        with stored.watch() as changed:
            while pending:
                ready = [chunk for chunk in pending if stored.ready(chunk.layer, chunk.part, chunk.offset,
                                                                      chunk.length)]
                if not ready:
                    await self._wait_change(stored, changed, writer)
                    continue
                for chunk in ready:
                    payload = as_bytes(stored.layers[chunk.layer][chunk.part])[chunk.offset:chunk.offset + chunk.length]
                    header = DATA_HEADER.pack(chunk.layer, chunk.part, chunk.offset)
                    write_frame(writer, FrameType.DATA, header, payload)
                    await self._drain(writer)
                    sent += chunk.length
                done = set(ready)
                pending = [chunk for chunk in pending if chunk not in done]
        return sent

    async def _wait_change(self, stored: StoredKV, changed: Watch, writer: asyncio.StreamWriter) -> None:
        """Wait for prefill to add to the blob, with a KEEPALIVE to the client each keepalive_s; raise if the blob
        failed (aborted, replaced) or its lease ran out before it was complete."""
        stored.check()
        if not await changed.wait(self._keepalive):
            if stored.expires_at <= self.store.clock():
                raise KVTransferError("expired", f"the lease on KV for request {stored.meta.request_id!r} expired "
                                      "before prefill completed it")
            write_frame(writer, FrameType.KEEPALIVE)
            await self._drain(writer)
        stored.check()

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self._io_timeout):
                await writer.drain()
        except TimeoutError as error:
            raise KVTransferError("timeout", f"client did not read for {self._io_timeout:g} s") from error
        except (ConnectionError, OSError) as error:
            raise KVTransferError("connection", f"client connection lost: {error!r}") from error

    async def _send_error(self, writer: asyncio.StreamWriter, error: KVTransferError) -> None:
        with contextlib.suppress(Exception):
            write_error(writer, error.cause, error.message)
            async with asyncio.timeout(1.0):
                await writer.drain()
