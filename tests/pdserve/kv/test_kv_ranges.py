"""Range pulls over real loopback sockets: decode asks for blocks [first_block, n) only, and every block it gets is
verified against the per-block digests the blob checksum is made of."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdserve.kv import KVMetrics, KVTransferError, LeaseStore, SecretKey, pull
from pdserve.kv.blob import ArraySpec

from .kvtestlib import make_layers, meta_for, running_server

FAST = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "retries": 1, "backoff_s": 0.05}
BLOCKS = 12


def store_of(metrics: KVMetrics) -> LeaseStore:
    return LeaseStore(capacity_bytes=64 << 20, chunk_bytes=1000, metrics=metrics)  # chunks straddle blocks


def received_bytes(metrics: KVMetrics) -> float:
    return metrics.bytes.labels("receiver")._value.get()


@pytest.mark.parametrize(("first_block", "streams"), [(0, 1), (5, 3), (BLOCKS - 1, 2), (BLOCKS, 2)])
def test_a_range_pull_moves_and_verifies_only_the_blocks_asked_for(
    key: SecretKey, metrics: KVMetrics, first_block: int, streams: int
) -> None:
    layers = make_layers(3, (BLOCKS, 4, 24), "float16", seed=first_block)  # [blocks, heads, head_dim]
    store = store_of(metrics)
    stored = store.put("r", layers, meta_for("r"), unit_rows=1)

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            blob = await pull(
                "127.0.0.1",
                server.port,
                "r",
                stored.checksum,
                key=key,
                streams=streams,
                first_row=first_block,
                metrics=metrics,
                **FAST,
            )
            assert blob.first_row == first_block
            for (k, v), (k2, v2) in zip(layers, blob.layers, strict=True):
                assert k2[first_block:].tobytes() == k[first_block:].tobytes()
                assert v2[first_block:].tobytes() == v[first_block:].tobytes()

    asyncio.run(scenario())
    assert received_bytes(metrics) == stored.nbytes * (BLOCKS - first_block) // BLOCKS


def test_a_block_changed_after_hashing_is_caught_whichever_range_holds_it(key: SecretKey, metrics: KVMetrics) -> None:
    layers = make_layers(2, (BLOCKS, 64), "float32")
    store = store_of(metrics)
    stored = store.put("r", layers, meta_for("r"), unit_rows=1)
    stored.layers[1][0][7, 3] += 1.0  # block 7 of layer 1's K changes in prefill's memory after it was hashed

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            untouched = await pull("127.0.0.1", server.port, "r", stored.checksum, key=key, first_row=8, **FAST)
            assert untouched.layers[0][0][8:].tobytes() == layers[0][0][8:].tobytes()
            with pytest.raises(KVTransferError, match="layer 1 K bytes from 1792") as caught:
                await pull("127.0.0.1", server.port, "r", stored.checksum, key=key, streams=2, first_row=3, **FAST)
            assert caught.value.cause == "checksum"

    asyncio.run(scenario())


def test_a_blob_digested_whole_refuses_a_range(key: SecretKey, metrics: KVMetrics) -> None:
    store = store_of(metrics)
    stored = store.put("w", make_layers(2, (BLOCKS, 8), "float32"), meta_for("w"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            with pytest.raises(KVTransferError, match="first_row 2: this blob is verified in whole arrays") as caught:
                await pull("127.0.0.1", server.port, "w", stored.checksum, key=key, first_row=2, **FAST)
            assert caught.value.cause == "protocol"

    asyncio.run(scenario())


def test_a_range_of_a_streamed_blob_comes_as_its_blocks_are_added(key: SecretKey, metrics: KVMetrics) -> None:
    layers = make_layers(2, (BLOCKS, 256), "uint16")
    specs = tuple((ArraySpec.of(k), ArraySpec.of(v)) for k, v in layers)
    store = store_of(metrics)

    def prefill(entry_blocks: list[int]) -> None:
        entry = store.get("s")
        block_bytes = layers[0][0][0].nbytes
        for first in entry_blocks:  # chunked prefill: blocks [first, first + 4) of every layer, then the next four
            for index, (k, v) in enumerate(layers):
                for part, array in enumerate((k, v)):
                    flat = np.ascontiguousarray(array[first : first + 4]).reshape(-1).view(np.uint8)
                    entry.add(index, part, first * block_bytes, flat)
        entry.seal()

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            store.open("s", meta_for("s"), specs, unit_rows=1)
            blob, _ = await asyncio.gather(
                pull("127.0.0.1", server.port, "s", None, key=key, streams=2, first_row=6, **FAST),
                asyncio.to_thread(prefill, [0, 4, 8]),
            )
            for (k, v), (k2, v2) in zip(layers, blob.layers, strict=True):
                assert k2[6:].tobytes() == k[6:].tobytes() and v2[6:].tobytes() == v[6:].tobytes()
            assert store.get("s").checksum == store_of(metrics).put("s", layers, meta_for("s"), unit_rows=1).checksum

    asyncio.run(scenario())
