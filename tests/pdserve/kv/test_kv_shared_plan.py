"""The streams of a pull share its chunks (protocol 4): a slow stream carries less instead of holding the pull's tail;
each stream index joins a pull once; the server forgets a pull once its streams ended; protocol 3 peers are refused."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from pdserve.kv import KVMetrics, KVTransferError, LeaseStore, SecretKey, pull
from pdserve.kv.connect import Connector
from pdserve.kv.protocol import HEADER, MAGIC, FrameType, crc32c, json_payload
from pdserve.kv.wire import FrameSocket

from .kvtestlib import make_layers, meta_for, proxy_to, running_server

FAST = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "retries": 1, "backoff_s": 0.05}
CHUNK = 64 << 10


@pytest.mark.slow  # a throttled stream (about 3 s)
def test_a_throttled_stream_carries_fewer_chunks_and_the_pull_is_whole(key: SecretKey, metrics: KVMetrics) -> None:
    """One of 4 connections crawls at 1 MB/s, the others run at loopback speed: the crawling one carries far less
    than the quarter a static split (stream s takes chunks s, s+4, ...) would hand it, and every byte still arrives
    verified."""
    layers = make_layers(8, (2 << 20,), "uint8")  # 16 MiB in 256 chunks of 64 KiB
    store = LeaseStore(capacity_bytes=64 << 20, chunk_bytes=CHUNK, metrics=metrics)
    stored = store.put("slow-1", layers, meta_for("slow-1"))

    async def scenario() -> list[int]:
        async with (
            running_server(store, key, metrics=metrics) as server,
            proxy_to(server.port, bytes_per_second=1e6, throttled_connections=1) as proxy,
        ):
            blob = await pull("127.0.0.1", proxy.port, "slow-1", stored.checksum, key=key, streams=4, **FAST)
            for (k, v), (k2, v2) in zip(layers, blob.layers, strict=True):
                assert k2.tobytes() == k.tobytes() and v2.tobytes() == v.tobytes()
            assert server.shared_pulls == 0  # every stream ended: the server holds nothing of the pull
            return proxy.per_connection

    per_connection = asyncio.run(scenario())
    assert len(per_connection) == 4
    assert per_connection[0] < stored.nbytes / 8, per_connection  # a static split gives it stored.nbytes / 4


def _pull_frame(request: dict[str, object]) -> dict[str, object]:
    return {"request_id": "dup-1", "pull": "p-1", "streams": 2, "first_row": 0, **request}


def _serve_one_stream(channel: FrameSocket, stream: int) -> tuple[int, FrameType]:
    """PULL stream `stream` of pull p-1 on a raw authenticated connection: the DATA frames it got, and the last
    frame's type (END, or ERROR)."""
    channel.send(5.0, FrameType.PULL, json_payload(_pull_frame({"stream": stream})))
    data = 0
    while True:
        frame = channel.read_reply(5.0, CHUNK + 64)
        if frame.type is FrameType.DATA:
            data += 1
        elif frame.type in (FrameType.END, FrameType.ERROR):
            return data, frame.type


def test_a_stream_index_joins_a_pull_once_and_a_late_stream_gets_what_is_left(
    key: SecretKey, metrics: KVMetrics
) -> None:
    store = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=CHUNK, metrics=metrics)
    store.put("dup-1", make_layers(2, (CHUNK * 2,), "uint8"), meta_for("dup-1"))  # 8 chunks

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            connector = Connector(key, retries=0)
            first, again, late = [await connector.connect("127.0.0.1", server.port) for _ in range(3)]
            try:
                # Stream 0 alone takes every chunk: stream 1 has not come.
                assert await asyncio.to_thread(_serve_one_stream, first, 0) == (8, FrameType.END)
                assert server.shared_pulls == 1  # stream 1 of the pull may still come
                assert await asyncio.to_thread(_serve_one_stream, again, 0) == (0, FrameType.ERROR)
                assert await asyncio.to_thread(_serve_one_stream, late, 1) == (0, FrameType.END)
                assert server.shared_pulls == 0
            finally:
                for channel in (first, again, late):
                    channel.close()

    asyncio.run(scenario())


def _v3_frame(frame_type: FrameType, payload: bytes) -> bytes:
    crc = crc32c(payload, crc32c(HEADER.pack(MAGIC, 3, frame_type, 0, len(payload), 0)[:16]))
    return HEADER.pack(MAGIC, 3, frame_type, 0, len(payload), crc) + payload


def test_a_protocol_3_client_is_refused_naming_both_versions(key: SecretKey, metrics: KVMetrics) -> None:
    store = LeaseStore(capacity_bytes=1 << 20, metrics=metrics)

    async def scenario() -> bytes:
        async with running_server(store, key, metrics=metrics) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(_v3_frame(FrameType.HELLO, bytes(32)))
            header = await asyncio.wait_for(reader.readexactly(HEADER.size), timeout=5)
            reply = header + await asyncio.wait_for(reader.readexactly(HEADER.unpack(header)[4]), timeout=5)
            writer.close()
            return reply

    reply = asyncio.run(scenario())
    assert reply[5] == FrameType.ERROR
    assert b"unsupported protocol version 3 (this side speaks 4)" in reply


def test_a_protocol_3_server_is_refused_naming_both_versions(key: SecretKey) -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def old_server() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(_v3_frame(FrameType.CHALLENGE, bytes(64)))
            with contextlib.suppress(OSError):
                conn.recv(1024)  # until the client hangs up

    async def scenario() -> None:
        serving = asyncio.create_task(asyncio.to_thread(old_server))
        with pytest.raises(KVTransferError) as raised:
            await pull(
                "127.0.0.1",
                listener.getsockname()[1],
                "old",
                None,
                key=key,
                streams=1,
                retries=0,
                connect_timeout_s=2.0,
                read_timeout_s=2.0,
            )
        await serving
        assert raised.value.cause == "protocol"
        assert "unsupported protocol version 3 (this side speaks 4)" in raised.value.message

    try:
        asyncio.run(scenario())
    finally:
        listener.close()
