"""An active attacker on the path, without the key and without TLS, cannot make decode accept KV it rewrote.

The proxy relays the handshake untouched, then swaps every DATA payload for another blob's bytes and recomputes
everything an attacker can recompute: the manifest's checksum, the unit digests, END's blob checksum, every frame's
CRC-32C. Only END's MAC, made under the session key both sides derived from the handshake, gives it away.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv import KVMetrics, KVTransferError, LeaseStore, SecretKey, pull
from pdserve.kv.blob import as_bytes
from pdserve.kv.entry import StoredKV
from pdserve.kv.protocol import DATA_HEADER, HEADER, FrameType, encode_header

from .kvtestlib import LoopbackProxy, make_layers, meta_for, running_server

FAST = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "retries": 0}


class RewritingProxy(LoopbackProxy):
    """Forwards client bytes as they are; parses the server's frames and, when `forged` is set, rewrites them into
    `forged`'s KV with every unkeyed check recomputed."""

    def __init__(self, upstream_port: int, forged: StoredKV | None) -> None:
        self.upstream_port = upstream_port
        self.forged = forged
        self.rewritten = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        pumps = [
            asyncio.create_task(self._upstream(client_reader, up_writer)),
            asyncio.create_task(self._downstream(up_reader, client_writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        client_writer.close()
        up_writer.close()

    async def _upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            header = await reader.readexactly(HEADER.size)
            _magic, _version, raw_type, _flags, length, _crc = HEADER.unpack(header)
            payload = await reader.readexactly(length)
            frame_type = FrameType(raw_type)
            new_payload = self._rewrite(frame_type, payload) if self.forged is not None else payload
            writer.write(encode_header(frame_type, new_payload) + new_payload)
            await writer.drain()

    def _rewrite(self, frame_type: FrameType, payload: bytes) -> bytes:
        forged = self.forged
        assert forged is not None
        if frame_type is FrameType.MANIFEST:
            payload = forged.manifest.to_bytes()
        elif frame_type is FrameType.DATA:
            layer, part, offset = DATA_HEADER.unpack_from(payload)
            length = len(payload) - DATA_HEADER.size
            data = as_bytes(forged.layers[layer][part])[offset : offset + length]
            payload = payload[: DATA_HEADER.size] + bytes(data)
        elif frame_type is FrameType.DIGESTS:
            payload = forged.digests
        elif frame_type is FrameType.END:
            body = json.loads(payload)
            body["checksum"] = forged.checksum
            payload = json.dumps(body, sort_keys=True).encode()
        else:
            return payload
        self.rewritten += 1
        return payload


def _stores(metrics: KVMetrics) -> tuple[LeaseStore, StoredKV, StoredKV]:
    layers, other = make_layers(4, (8, 64), "float16", seed=1), make_layers(4, (8, 64), "float16", seed=2)
    store = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=1024, metrics=metrics)
    genuine = store.put("mitm-1", layers, meta_for("mitm-1"))
    attacker = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=1024, metrics=KVMetrics(CollectorRegistry()))
    forged = attacker.put("mitm-1", other, meta_for("mitm-1"))
    assert forged.checksum != genuine.checksum
    return store, genuine, forged


@pytest.mark.parametrize("streams", [1, 3])
def test_kv_rewritten_on_the_path_with_recomputed_checks_is_refused(
    key: SecretKey, metrics: KVMetrics, streams: int
) -> None:
    store, genuine, forged = _stores(metrics)

    async def scenario() -> None:
        async with running_server(store, key) as server:
            proxy = RewritingProxy(server.port, forged)
            await proxy.start()
            try:
                # Early dispatch: decode has no checksum from signed params, only what the server announces.
                with pytest.raises(KVTransferError) as caught:
                    await pull(
                        "127.0.0.1", proxy.port, "mitm-1", None, key=key, streams=streams, metrics=metrics, **FAST
                    )
                assert caught.value.cause == "auth"
                assert "MAC" in caught.value.message
                assert proxy.rewritten > 0
                proxy.forged = None  # the same path, relaying faithfully, delivers the genuine KV
                blob = await pull("127.0.0.1", proxy.port, "mitm-1", None, key=key, streams=streams, **FAST)
                assert [k.tobytes() for k, _v in blob.layers] == [k.tobytes() for k, _v in genuine.layers]
            finally:
                await proxy.close()

    asyncio.run(scenario())
    assert metrics.failures.labels("receiver", "auth")._value.get() == 1
