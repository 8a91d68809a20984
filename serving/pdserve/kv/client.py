"""The decode side of the KV channel: pull a blob over N parallel streams, verify it, then acknowledge it."""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass

import numpy as np

from pdserve.kv import auth
from pdserve.kv.blob import KVBlob, Layer, Manifest, as_bytes, blob_checksum, layer_digest
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.protocol import (
    DATA_HEADER,
    Chunk,
    FrameType,
    chunk_plan,
    expect,
    read_frame,
    write_frame,
    write_json,
)

STREAM_BUFFER_LIMIT = 8 << 20


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

    async def connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Open an authenticated connection, retrying refused or timed-out connects with exponential backoff."""
        for attempt in range(self.retries + 1):
            try:
                return await self._connect_once(host, port)
            except KVTransferError as error:
                if error.cause not in ("connection", "timeout") or attempt == self.retries:
                    raise
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def _connect_once(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host,
                    port,
                    ssl=self.ssl_context,
                    server_hostname=self.server_hostname if self.ssl_context else None,
                    limit=STREAM_BUFFER_LIMIT,
                )
        except TimeoutError as error:
            message = f"connect to {host}:{port} took over {self.connect_timeout_s:g} s"
            raise KVTransferError("timeout", message) from error
        except ssl.SSLError as error:
            raise KVTransferError("auth", f"TLS handshake with {host}:{port} failed: {error.reason}") from error
        except OSError as error:
            message = f"cannot connect to {host}:{port}: {error.strerror or error}"
            raise KVTransferError("connection", message) from error
        try:
            await self._handshake(reader, writer)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_nonce = auth.new_nonce()
        write_frame(writer, FrameType.HELLO, client_nonce)
        challenge = expect(await read_frame(reader, self.read_timeout_s), FrameType.CHALLENGE).payload
        server_nonce, proof = challenge[:32], challenge[32:]
        auth.verify(auth.server_proof(self.key, client_nonce, server_nonce), proof, "server")
        # The AUTH frame is not answered; the request that follows it is, which saves a round trip.
        write_frame(writer, FrameType.AUTH, auth.client_proof(self.key, client_nonce, server_nonce))


class _Assembly:
    """Destination arrays for one pull; hashes each layer (in a worker thread) as soon as its last byte lands."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.plan = chunk_plan(manifest)
        self.layers: list[Layer] = [
            (np.empty(k.shape, np.dtype(k.dtype)), np.empty(v.shape, np.dtype(v.dtype))) for k, v in manifest.layers
        ]
        self._views = [(as_bytes(k), as_bytes(v)) for k, v in self.layers]
        self._missing = [k.nbytes + v.nbytes for k, v in manifest.layers]
        self._digests: list[asyncio.Future[bytes] | None] = [None] * len(self.layers)
        for index, missing in enumerate(self._missing):
            if missing == 0:
                self._start_digest(index)

    def place(self, payload: bytes, expected: Chunk) -> None:
        layer, part, offset = DATA_HEADER.unpack_from(payload)
        data = memoryview(payload)[DATA_HEADER.size :]
        if (layer, part, offset, len(data)) != (expected.layer, expected.part, expected.offset, expected.length):
            raise KVTransferError(
                "protocol",
                f"got chunk (layer {layer}, part {part}, offset {offset}, {len(data)} bytes), expected {expected}",
            )
        self._views[layer][part][offset : offset + len(data)] = data
        self._missing[layer] -= len(data)
        if self._missing[layer] == 0:
            self._start_digest(layer)

    def _start_digest(self, index: int) -> None:
        self._digests[index] = asyncio.get_running_loop().run_in_executor(None, layer_digest, self.layers[index])

    async def checksum(self) -> str:
        if any(digest is None for digest in self._digests):
            raise KVTransferError("protocol", "transfer ended with layers still missing bytes")
        digests = await asyncio.gather(*(d for d in self._digests if d is not None))
        return blob_checksum(self.manifest.meta, self.manifest.layers, list(digests))


@dataclass
class _Pull:
    request_id: str
    expected_checksum: str
    expected_fingerprint: str | None
    streams: int
    assembly: _Assembly | None = None
    manifest_bytes: bytes | None = None

    def assembly_for(self, manifest_bytes: bytes) -> _Assembly:
        """The shared destination, created by whichever stream's manifest arrives first; all must agree."""
        if self.assembly is not None:
            if manifest_bytes != self.manifest_bytes:
                raise KVTransferError("protocol", "streams of one pull received different manifests")
            return self.assembly
        try:
            manifest = Manifest.from_bytes(manifest_bytes)
        except (ValueError, KeyError, TypeError) as error:
            raise KVTransferError("protocol", f"malformed manifest: {error}") from error
        self._check(manifest)
        self.manifest_bytes = manifest_bytes
        self.assembly = _Assembly(manifest)
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
        if manifest.checksum != self.expected_checksum:
            raise KVTransferError("checksum", "the prefill server's manifest announces a different checksum")


async def pull(
    host: str,
    port: int,
    request_id: str,
    expected_checksum: str,
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
) -> KVBlob:
    """Pull the KV of `request_id`, verify every frame and the whole blob, and return it (the lease stays held)."""
    if streams < 1:
        raise ValueError(f"streams: must be at least 1, got {streams}")
    connector = Connector(key, ssl_context, server_hostname, connect_timeout_s, read_timeout_s, retries, backoff_s)
    recorder = metrics if metrics is not None else default_metrics()
    state = _Pull(request_id, expected_checksum, expected_fingerprint, streams)
    started = time.perf_counter()
    try:
        await _run_streams(connector, host, port, state)
        assert state.assembly is not None
        if await state.assembly.checksum() != expected_checksum:
            raise KVTransferError("checksum", "assembled KV does not match the checksum prefill announced")
    except KVTransferError as error:
        recorder.observe_failure("receiver", error.cause)
        raise
    blob = KVBlob(state.assembly.manifest.meta, state.assembly.layers)
    recorder.observe_transfer("receiver", blob.nbytes, time.perf_counter() - started)
    return blob


async def _run_streams(connector: Connector, host: str, port: int, state: _Pull) -> None:
    tasks = [
        asyncio.create_task(_pull_stream(connector, host, port, state, index)) for index in range(state.streams)
    ]
    _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    failed = [task.exception() for task in tasks if task.done() and not task.cancelled() and task.exception()]
    if failed:
        raise failed[0]  # type: ignore[misc]


async def _pull_stream(connector: Connector, host: str, port: int, state: _Pull, index: int) -> None:
    reader, writer = await connector.connect(host, port)
    timeout = connector.read_timeout_s
    try:
        write_json(writer, FrameType.PULL, {"request_id": state.request_id, "stream": index, "streams": state.streams})
        assembly = state.assembly_for(expect(await read_frame(reader, timeout), FrameType.MANIFEST).payload)
        max_payload = DATA_HEADER.size + assembly.manifest.chunk_bytes
        chunks = assembly.plan[index :: state.streams]
        for chunk in chunks:
            frame = expect(await read_frame(reader, timeout, max_payload), FrameType.DATA)
            assembly.place(frame.payload, chunk)
        end = expect(await read_frame(reader, timeout), FrameType.END).json()
        if end.get("chunks") != len(chunks):
            raise KVTransferError("protocol", f"stream {index} ended after {end.get('chunks')} of {len(chunks)} chunks")
    finally:
        writer.close()


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
) -> bool:
    """Tell prefill the KV arrived so it frees the lease; True if the server still held it."""
    connector = Connector(key, ssl_context, server_hostname, connect_timeout_s, read_timeout_s, retries)
    reader, writer = await connector.connect(host, port)
    try:
        write_json(writer, FrameType.ACK, {"request_id": request_id})
        reply = expect(await read_frame(reader, read_timeout_s), FrameType.ACK_OK).json()
        return bool(reply.get("released"))
    finally:
        writer.close()
