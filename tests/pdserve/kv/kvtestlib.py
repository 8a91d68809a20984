"""Helpers for the KV channel tests: synthetic KV, a running server (in this process or its own) and a byte-level
TCP proxy for fault injection."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.kv import KVMeta, KVServer, KVTransferError, Layer, LeaseStore, SecretKey
from pdserve.kv.protocol import HEADER, MAX_CONTROL_PAYLOAD, Frame, FrameType, Header, check_header

HERE = Path(__file__).parent


def make_layers(count: int, shape: tuple[int, ...], dtype: str, seed: int = 0) -> list[Layer]:
    rng = np.random.default_rng(seed)
    layers: list[Layer] = []
    for _ in range(count):
        pair = []
        for _part in range(2):
            raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
            pair.append(raw.view(dtype).reshape(shape))
        layers.append((pair[0], pair[1]))
    return layers


def address(array: np.ndarray) -> int:
    """Where an array's bytes are: two arrays at one address share memory (a reused mapping)."""
    return int(array.__array_interface__["data"][0])


def meta_for(request_id: str, token_count: int = 7, fingerprint: str = "fp-test-1") -> KVMeta:
    return KVMeta(request_id=request_id, token_count=token_count, fingerprint=fingerprint)


@contextlib.asynccontextmanager
async def running_server(store: LeaseStore, key: SecretKey, **options: object) -> AsyncIterator[KVServer]:
    server = KVServer(store, key, **options)  # type: ignore[arg-type]
    await server.start()
    try:
        yield server
    finally:
        await server.close()


class LoopbackProxy:
    """A listener on a loopback port whose connections `_handle` serves; close() cancels the tasks it ran."""

    port: int
    _server: asyncio.Server | None
    _tasks: set[asyncio.Task[None]]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


@dataclass
class ByteProxy(LoopbackProxy):
    """A loopback TCP proxy that can flip one server-to-client byte, throttle, report how much it forwarded, and
    drop the connections it holds the next time their client uses them."""

    upstream_port: int
    corrupt_at: int | None = None
    bytes_per_second: float | None = None
    throttled_connections: int | None = None  # throttle only the first this many connections (None: all)
    forwarded: int = 0
    per_connection: list[int] = field(default_factory=list)  # server-to-client bytes of each, in accept order
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    on_forward: Callable[[int], None] | None = None
    _clients: set[asyncio.StreamWriter] = field(default_factory=set)
    _doomed: set[asyncio.StreamWriter] = field(default_factory=set)

    def sever_when_used(self) -> None:
        """The connections open now are closed, their request unforwarded, as soon as their client sends anything:
        a server that went away while a pooled connection sat idle, which the client notices only when it uses it."""
        self._doomed.update(self._clients)

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_writer.close()
            return
        self._clients.add(client_writer)
        index = len(self.per_connection)
        self.per_connection.append(0)
        pumps = [
            asyncio.create_task(self._pump(client_reader, up_writer, downstream=False, client=client_writer)),
            asyncio.create_task(
                self._pump(up_reader, client_writer, downstream=True, client=client_writer, index=index)
            ),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        self._clients.discard(client_writer)
        client_writer.close()
        up_writer.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        downstream: bool,
        client: asyncio.StreamWriter,
        index: int = 0,
    ) -> None:
        throttled = self.throttled_connections is None or index < self.throttled_connections
        while data := await reader.read(16384):
            if downstream:
                data = self._maybe_corrupt(data)
                self.forwarded += len(data)
                self.per_connection[index] += len(data)
                if self.on_forward is not None:
                    self.on_forward(self.forwarded)
                if self.bytes_per_second and throttled:
                    await asyncio.sleep(len(data) / self.bytes_per_second)
            elif client in self._doomed:
                return  # the connection ends here; the client's bytes never reach the server
            writer.write(data)
            await writer.drain()

    def _maybe_corrupt(self, data: bytes) -> bytes:
        if self.corrupt_at is None or not self.forwarded <= self.corrupt_at < self.forwarded + len(data):
            return data
        index = self.corrupt_at - self.forwarded
        return data[:index] + bytes([data[index] ^ 0x5A]) + data[index + 1 :]


@contextlib.asynccontextmanager
async def proxy_to(upstream_port: int, **options: object) -> AsyncIterator[ByteProxy]:
    proxy = ByteProxy(upstream_port, **options)  # type: ignore[arg-type]
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


@contextlib.contextmanager
def server_process(kv_key_file: Path, request_id: str, mib: int) -> Iterator[tuple[subprocess.Popen[str], int, str]]:
    """A KV server in its own process holding one blob: (process, port, checksum)."""
    with synthetic_server(kv_key_file, request_id, mib) as server:
        yield server.process, server.port, server.checksum


@dataclass
class SyntheticServer:
    """A running synthetic_server.py: its process, KV port, blob checksum and metrics port."""

    process: subprocess.Popen[str]
    port: int
    checksum: str
    metrics_port: int


@contextlib.contextmanager
def synthetic_server(
    kv_key_file: Path, request_id: str, mib: int, *options: str, stderr: Path | None = None
) -> Iterator[SyntheticServer]:
    """synthetic_server.py in its own process; `options` are its own (--tls, ...), its log goes to `stderr` if given."""
    log = None if stderr is None else stderr.open("w")
    process = subprocess.Popen(
        [sys.executable, str(HERE / "synthetic_server.py"), str(kv_key_file), request_id, str(mib), *options],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=HERE,
    )
    try:
        assert process.stdout is not None
        port, checksum, metrics_port = process.stdout.readline().split()
        yield SyntheticServer(process, int(port), checksum, int(metrics_port))
    finally:
        process.kill()
        process.wait()
        if log is not None:
            log.close()


async def read_frame(reader: asyncio.StreamReader, timeout: float, max_payload: int = MAX_CONTROL_PAYLOAD) -> Frame:
    """One frame from an asyncio stream, checked as the KV channel checks it (pdserve.kv.wire reads sockets)."""
    try:
        async with asyncio.timeout(timeout):
            raw = await reader.readexactly(HEADER.size)
            magic, version, raw_type, _flags, length, crc = HEADER.unpack(raw)
            check_header(magic, version, raw_type, length, max_payload)
            payload = await reader.readexactly(length)
    except TimeoutError:
        raise KVTransferError("timeout", f"no complete frame within {timeout:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionError) as error:
        raise KVTransferError("connection", f"connection lost while reading a frame: {error!r}") from None
    header = Header(FrameType(raw_type), length, crc, raw)
    header.check_crc(payload)
    return Frame(header.type, payload)
