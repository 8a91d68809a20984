"""The prefill side of one pull stream: check the PULL, wait for prefill to open the blob, send the chunks of the
pull's shared plan as prefill adds them (KEEPALIVEs while it waits), then DIGESTS (stream 0) and END under the
connection's session key."""

from __future__ import annotations

import contextlib
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve.kv import auth
from pdserve.kv.blob import as_bytes
from pdserve.kv.entry import StoredKV, Watch
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics
from pdserve.kv.protocol import DATA_HEADER, Chunk, Frame, FrameType, chunk_plan, json_payload
from pdserve.kv.share import PullShares, SharedPlan
from pdserve.kv.store import LeaseStore
from pdserve.kv.wire import FrameSocket

MAX_STREAMS = 64
MAX_PULL_ID = 64
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")  # W3C trace context, version 00
# Unsent bytes a stream of a multi-stream pull may queue in the kernel before a send blocks: it takes its pull's next
# chunk only once this little of its last one is left to go, so chunks go to the streams whose flows are moving
# (pdserve.kv.share). Measured: bench/results/kv_channel-2026-12-01-s7-wan.md.
NOTSENT_LOWAT_BYTES = 256 << 10


@dataclass
class PullSender:
    """Serves the PULL requests of a KVServer's connections from its LeaseStore (see KVServer for the settings)."""

    store: LeaseStore
    metrics: KVMetrics
    io_timeout_s: float
    idle_timeout_s: float
    open_wait_s: float
    keepalive_s: float
    notsent_lowat_bytes: int
    shares: PullShares = field(init=False)

    def __post_init__(self) -> None:
        self.shares = PullShares(ttl_s=self.io_timeout_s + self.idle_timeout_s)

    @property
    def shared_pulls(self) -> int:
        return len(self.shares)

    def serve(self, frame: Frame, channel: FrameSocket, session: bytes) -> None:
        request = _pull_request(frame)
        with _serve_span(frame, request) as span:
            sent, chunks = self._serve_stream(request, channel, session)
            span.set_attributes({"pdserve.kv.bytes": sent, "pdserve.kv.chunks": chunks})

    def _serve_stream(self, request: dict[str, Any], channel: FrameSocket, session: bytes) -> tuple[int, int]:
        request_id, stream, streams, first_row = (
            request["request_id"],
            request["stream"],
            request["streams"],
            request["first_row"],
        )
        stored = self._wait_open(request_id, channel)
        # Only streams that share chunks need to keep little unsent; one stream alone keeps the kernel's whole buffer
        # as slack for the moments its thread does not run (0: the system's default, no limit).
        _set_notsent_lowat(channel.sock, self.notsent_lowat_bytes if streams > 1 else 0)
        started = time.perf_counter()
        manifest = stored.manifest.to_bytes()
        channel.send(self.io_timeout_s, FrameType.MANIFEST, manifest)
        key = (request_id, request["pull"], streams, first_row)
        with self.shares.join(key, stream, stored, lambda: _plan(stored, first_row)) as shared:
            chunks, sent = self._send_chunks(stored, shared, stream, channel)
            if not stored.checksum:  # sealed and hashed
                with stored.watch() as changed:
                    while not stored.checksum:
                        self._wait_change(stored, changed, channel)
            if stream == 0:
                channel.send(self.io_timeout_s, FrameType.DIGESTS, stored.digests)
        # Out of the shared plan before END: once the client has every END, the server holds nothing of the pull.
        mac = auth.end_mac(session, manifest, request, stored.checksum, chunks)
        channel.send(
            self.io_timeout_s,
            FrameType.END,
            json_payload({"chunks": chunks, "bytes": sent, "checksum": stored.checksum, "mac": mac}),
        )
        self.metrics.observe_transfer("sender", sent, time.perf_counter() - started)
        return sent, chunks

    def _wait_open(self, request_id: str, channel: FrameSocket) -> StoredKV:
        """The blob of `request_id`, waiting up to open_wait_s for prefill to open it (then `not_found`)."""
        try:
            return self.store.get(request_id)
        except KVTransferError as error:
            if error.cause != "not_found" or self.open_wait_s <= 0:
                raise
        deadline = time.monotonic() + self.open_wait_s
        with self.store.watch() as opened:
            while True:
                try:
                    return self.store.get(request_id)
                except KVTransferError as error:
                    if error.cause != "not_found" or self.store.gone(request_id) or time.monotonic() >= deadline:
                        raise
                self._idle(opened, channel, deadline)

    def _send_chunks(self, stored: StoredKV, shared: SharedPlan, stream: int, channel: FrameSocket) -> tuple[int, int]:
        """Take the pull's next chunk prefill has added, send it, and so on until none is left; return the chunks and
        bytes this stream sent."""
        views = [as_bytes(array) for pair in stored.layers for array in pair]
        chunks = sent = 0

        def ready(chunk: Chunk) -> bool:  # once sealed every chunk is: no look at each (a scan of the rest)
            return stored.sealed or stored.ready(chunk.layer, chunk.part, chunk.offset, chunk.length)

        while True:
            chunk, left = shared.take(stream, ready)
            if chunk is not None:
                payload = views[2 * chunk.layer + chunk.part][chunk.offset : chunk.offset + chunk.length]
                channel.send(
                    self.io_timeout_s, FrameType.DATA, DATA_HEADER.pack(chunk.layer, chunk.part, chunk.offset), payload
                )
                chunks, sent = chunks + 1, sent + chunk.length
                stored.count_sent(chunk.length)
            elif not left:
                return chunks, sent
            else:
                with stored.watch() as changed:  # then look again: no change after the look above is missed
                    if not shared.any_ready(ready):
                        self._wait_change(stored, changed, channel)

    def _wait_change(self, stored: StoredKV, changed: Watch, channel: FrameSocket) -> None:
        """Wait for prefill to add to the blob, with a KEEPALIVE to the client each keepalive_s; raise if the blob
        failed (aborted, replaced) or its lease ran out before it was complete."""
        stored.check()
        if not self._idle(changed, channel) and stored.expires_at <= self.store.clock():
            self.store.reap()  # free it now, not at the reaper's next round: the pull that noticed ends here
            raise KVTransferError(
                "expired", f"the lease on KV for request {stored.meta.request_id!r} expired before prefill completed it"
            )
        stored.check()

    def _idle(self, watch: Watch, channel: FrameSocket, until: float | None = None) -> bool:
        """Wait for `watch` (True if it was set) until a KEEPALIVE is due, and send one when it is. Due counts from
        the last frame sent, not from the last wake: the watches wake on changes this pull may not need (other
        streams' chunks, other entries opening, digests), and under a steady stream of those a client waiting
        longer than its read timeout for its own next frame would give up."""
        due = channel.last_sent + self.keepalive_s
        changed = watch.wait(max(0.0, min(due, until if until is not None else due) - time.monotonic()))
        if time.monotonic() >= channel.last_sent + self.keepalive_s:
            channel.send(self.io_timeout_s, FrameType.KEEPALIVE)
        return changed


def _pull_request(frame: Frame) -> dict[str, Any]:
    """A PULL's fields, checked: what END's MAC covers."""
    body = frame.json()
    fields = ("request_id", "pull", "stream", "streams", "first_row")
    request: dict[str, Any] = {name: body.get(name) for name in fields}
    if (
        not isinstance(request["request_id"], str)
        or not isinstance(request["pull"], str)
        or not all(isinstance(request[name], int) for name in ("stream", "streams", "first_row"))
    ):
        raise KVTransferError(
            "protocol", "PULL needs request_id and pull (strings), stream, streams and first_row (integers)"
        )
    stream, streams, first_row = request["stream"], request["streams"], request["first_row"]
    if not 1 <= streams <= MAX_STREAMS or not 0 <= stream < streams or first_row < 0:
        raise KVTransferError("protocol", f"PULL stream {stream} of {streams} from row {first_row} is out of range")
    if not 1 <= len(request["pull"]) <= MAX_PULL_ID:
        raise KVTransferError(
            "protocol", f"PULL pull id: expected 1 to {MAX_PULL_ID} characters, got {len(request['pull'])}"
        )
    return request


def _serve_span(frame: Frame, request: dict[str, Any]) -> contextlib.AbstractContextManager[trace.Span]:
    """A span for serving one stream, in the puller's trace when its PULL carries a well-formed traceparent (not
    covered by the END MAC: it only places the span); none without one."""
    parent = frame.json().get("traceparent")
    if not isinstance(parent, str) or not TRACEPARENT.fullmatch(parent):
        return contextlib.nullcontext(trace.INVALID_SPAN)
    context = TraceContextTextMapPropagator().extract({"traceparent": parent})
    return trace.get_tracer("pdserve.kv").start_as_current_span(
        "kv serve",
        context=context,
        kind=trace.SpanKind.SERVER,
        attributes={
            "pdserve.kv.remote_request_id": request["request_id"],
            "pdserve.kv.stream": request["stream"],
            "pdserve.kv.streams": request["streams"],
        },
    )


def _plan(stored: StoredKV, first_row: int) -> list[Chunk]:
    try:
        return chunk_plan(stored.manifest, first_row)
    except ValueError as error:
        raise KVTransferError("protocol", f"PULL first_row: {error}") from None


def _set_notsent_lowat(sock: socket.socket, limit: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, limit)
