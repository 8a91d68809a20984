"""The decode side of the KV channel: pull a blob over N parallel streams, verify it, then acknowledge it.

`pull` and `ack` are coroutines, but each stream runs on its own thread with a blocking socket (pdserve.kv.wire):
DATA lands by recv_into straight in the destination array, its CRC-32C is checked there, and each digest unit is
hashed (BLAKE3) on a verify thread as soon as its last byte is in; the socket calls and hashes release the GIL, so
streams use as many cores as there are. The event loop only starts the streams and waits for them.

The connections (pdserve.kv.connect), their pool (pdserve.kv.pool), one request on one (pdserve.kv.route) and what
a pull receives (pdserve.kv.assembly) have modules of their own; this one runs pulls and acks over them.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

from opentelemetry import propagate

from pdserve.common.kv_tls import SocketWrapper
from pdserve.kv import auth
from pdserve.kv.assembly import PullState
from pdserve.kv.blob import KVBlob, Manifest
from pdserve.kv.connect import CAPACITY_WAIT_S, Connector
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.pool import KVConnection, KVConnectionPool
from pdserve.kv.protocol import FrameType, expect
from pdserve.kv.route import Route, first_reply


async def pull(
    host: str,
    port: int,
    request_id: str,
    expected_checksum: str | None,
    *,
    key: auth.SecretKey,
    streams: int = 4,
    expected_fingerprint: str | None = None,
    ssl_context: SocketWrapper | None = None,
    server_hostname: str | None = None,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 10.0,
    retries: int = 2,
    backoff_s: float = 0.2,
    metrics: KVMetrics | None = None,
    pool: KVConnectionPool | None = None,
    first_row: int = 0,
    max_bytes: int | None = None,
    stall_timeout_s: float | None = None,
    capacity_wait_s: float = CAPACITY_WAIT_S,
) -> KVBlob:
    """Pull the KV of `request_id`, verify every frame and the whole blob, and return it (the lease stays held).

    `expected_checksum` is the one prefill's signed params announced; None for a pull started before prefill ended
    (early dispatch): the blob must then match the checksum the authenticated server announces at END, and the
    caller checks the manifest's token count.

    With `first_row` > 0 only leading rows (blocks) from that one on are sent (decode has the others); every unit
    sent is verified against the digests that make up the blob checksum.

    With `max_bytes`, a manifest announcing more KV than that is refused (`protocol`) before anything is allocated
    for it: the server authenticated, but its bytes are verified only as they arrive.

    With a `pool`, each stream borrows a connection from it (the pool's metrics count those connections) and gives
    it back after a clean END; without one, each stream opens and closes its own.

    A stream fails `timeout` when no byte of a frame came for `read_timeout_s` and the server's TCP stack stopped
    answering too (a host or link gone), or when nothing came for `stall_timeout_s` (default STALL_READ_TIMEOUTS read
    timeouts) although it answers (a server process kept off the CPU that long): pdserve.kv.wire.

    A server at its cap of connections (`capacity`) is tried again for up to `capacity_wait_s` (pdserve.kv.connect).
    """
    if streams < 1:
        raise ValueError(f"streams: must be at least 1, got {streams}")
    if first_row < 0:
        raise ValueError(f"first_row: must be at least 0, got {first_row}")
    recorder = metrics if metrics is not None else default_metrics()
    connector = Connector(
        key,
        ssl_context,
        server_hostname,
        connect_timeout_s,
        read_timeout_s,
        retries,
        backoff_s,
        stall_timeout_s,
        capacity_wait_s,
        recorder,
    )
    state = PullState(
        request_id, expected_checksum, expected_fingerprint, streams, first_row, max_bytes, trace=_trace_context()
    )
    started = time.perf_counter()
    try:
        await _run_streams(Route(connector, host, port, pool, recorder), state)
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


async def _run_streams(route: Route, state: PullState) -> None:
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


async def _pull_stream(route: Route, state: PullState, index: int) -> None:
    request = {
        "request_id": state.request_id,
        "pull": state.pull_id,
        "stream": index,
        "streams": state.streams,
        "first_row": state.first_row,
    }
    await route.exchange(_receive_stream, state, request, route.connector.read_timeout_s)


def _receive_stream(connection: KVConnection, state: PullState, request: dict[str, Any], timeout: float) -> None:
    """One stream of a pull, on its thread: PULL, MANIFEST, the DATA chunks the server gives this stream, (DIGESTS,)
    END."""
    channel = connection.channel
    index = int(request["stream"])
    manifest = expect(
        first_reply(channel, FrameType.PULL, {**request, **state.trace}, timeout), FrameType.MANIFEST
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
    ssl_context: SocketWrapper | None = None,
    server_hostname: str | None = None,
    connect_timeout_s: float = 5.0,
    read_timeout_s: float = 10.0,
    retries: int = 2,
    metrics: KVMetrics | None = None,
    pool: KVConnectionPool | None = None,
    stall_timeout_s: float | None = None,
    capacity_wait_s: float = CAPACITY_WAIT_S,
) -> bool:
    """Tell prefill the KV arrived so it frees the lease; True if the server still held it."""
    recorder = metrics if metrics is not None else default_metrics()
    connector = Connector(
        key,
        ssl_context,
        server_hostname,
        connect_timeout_s,
        read_timeout_s,
        retries,
        stall_timeout_s=stall_timeout_s,
        capacity_wait_s=capacity_wait_s,
        metrics=recorder,
    )
    route = Route(connector, host, port, pool, recorder)
    return await route.exchange(_send_ack, request_id, read_timeout_s)


def _send_ack(connection: KVConnection, request_id: str, timeout: float) -> bool:
    reply = first_reply(connection.channel, FrameType.ACK, {"request_id": request_id}, timeout)
    return bool(expect(reply, FrameType.ACK_OK).json().get("released"))


def _trace_context() -> dict[str, str]:
    """The W3C traceparent of the caller's current span (nothing when there is none, e.g. tracing off), so that the
    server's side of the pull joins the caller's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {"traceparent": carrier["traceparent"]} if "traceparent" in carrier else {}
