"""The decode side's receive path: DATA payloads land straight in their destination array.

asyncio's StreamReader costs three copies per byte (the socket's recv into a new bytes object, the extend into its
buffer, readexactly's copy out) before decode copies into the KV array. `KVStreamReader` is an asyncio
BufferedProtocol: while a DATA payload is being read, the transport's recv_into (or, with TLS, the decrypted bytes)
goes directly into the slice of the destination array, one copy from the kernel; headers and control frames go
through a small scratch buffer. It offers the StreamReader calls the client uses (readexactly, at_eof, exception)
and `read_into`.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import ssl
from asyncio.streams import FlowControlMixin
from typing import Any

import numpy as np

SCRATCH_BYTES = 256 << 10
HUGE_PAGE_BYTES = 2 << 20
ALIGN = 64
PAUSE_ABOVE = 8 << 20  # unconsumed bytes held before the transport is paused (reading then waits for the client)


class KVStreamReader(FlowControlMixin, asyncio.BufferedProtocol):
    """The protocol and the reader of one client connection (the protocol of its asyncio.StreamWriter)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = bytearray()  # received, not yet consumed
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._sink: memoryview | None = None  # where the transport writes while read_into waits
        self._sink_filled = 0
        self._into_sink = False  # whether the last get_buffer handed out the sink
        self._eof = False
        self._exception: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._reading_paused = False
        self._closed: asyncio.Future[None] = self._loop.create_future()

    # asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        # Into the sink only while it has room and nothing received earlier waits to be consumed (order); once it is
        # full, later bytes go to the scratch buffer until read_into returns and the next read takes them.
        self._into_sink = self._sink is not None and not self._pending and self._sink_filled < len(self._sink)
        if self._into_sink:
            assert self._sink is not None
            return self._sink[self._sink_filled :]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_sink:
            assert self._sink is not None
            self._sink_filled += nbytes
            if self._sink_filled == len(self._sink):
                self._wake()
            return
        self._pending += self._scratch[:nbytes]
        if len(self._pending) > PAUSE_ABOVE and not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if exc is not None:
            self._exception = exc
        self._wake()
        super().connection_lost(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def _get_close_waiter(self, stream: Any) -> asyncio.Future[None]:
        return self._closed

    # the StreamReader calls the client makes

    def at_eof(self) -> bool:
        return self._eof and not self._pending

    def exception(self) -> BaseException | None:
        return self._exception

    async def readexactly(self, n: int) -> bytes:
        while len(self._pending) < n:
            await self._wait_for_data(n)
        data = bytes(self._pending[:n])
        del self._pending[:n]
        self._maybe_resume()
        return data

    async def read_into(self, view: memoryview) -> None:
        """Fill `view` (format 'B') with the next len(view) bytes; IncompleteReadError if the stream ends first."""
        size = len(view)
        filled = min(size, len(self._pending))
        if filled:
            view[:filled] = self._pending[:filled]
            del self._pending[:filled]
            self._maybe_resume()
        if filled == size:
            return
        self._sink, self._sink_filled = view[filled:], 0
        try:
            while self._sink_filled < len(self._sink):
                await self._wait_for_data(size, lambda: filled + self._sink_filled, view)
        finally:
            self._sink, self._into_sink = None, False

    async def _wait_for_data(self, wanted: int, have: Any = None, view: memoryview | None = None) -> None:
        if self._exception is not None:
            raise self._exception
        if self._eof:
            got = bytes(view[: have()]) if view is not None and have is not None else bytes(self._pending)
            raise asyncio.IncompleteReadError(got, wanted)
        self._maybe_resume()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _maybe_resume(self) -> None:
        if self._reading_paused and len(self._pending) <= PAUSE_ABOVE // 2 and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()


async def open_kv_connection(host: str, port: int, *, ssl_context: ssl.SSLContext | None,
                             server_hostname: str | None) -> tuple[KVStreamReader, asyncio.StreamWriter]:
    """Like asyncio.open_connection, with a KVStreamReader as the reader."""
    loop = asyncio.get_running_loop()
    reader = KVStreamReader()
    transport, _protocol = await loop.create_connection(lambda: reader, host, port, ssl=ssl_context,
                                                        server_hostname=server_hostname)
    return reader, asyncio.StreamWriter(transport, reader, None, loop)


async def read_into(reader: Any, view: memoryview) -> None:
    """Fill `view` from `reader`: in place from a KVStreamReader, through one more copy from a StreamReader."""
    if isinstance(reader, KVStreamReader):
        await reader.read_into(view)
    else:
        view[:] = await reader.readexactly(len(view))




def destination_arrays(specs: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """Empty arrays of these (shape, dtype), for a blob being received.

    A big blob's arrays share one anonymous mapping advised for transparent huge pages: the kernel then faults its
    memory in 2 MiB pages as bytes land instead of 4 KiB ones, which on this kind of machine costs less than a tenth
    (the first touch of fresh memory was the largest single cost of a cold pull)."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if total < HUGE_PAGE_BYTES or advice is None:
        return [np.empty(shape, np.dtype(dtype)) for shape, dtype in specs]
    region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP disabled: plain pages
        region.madvise(advice)
    return [np.frombuffer(region, np.dtype(dtype), int(np.prod(shape)), offset).reshape(shape)
            for (shape, dtype), offset in zip(specs, offsets, strict=True)]
