"""A pull waiting on prefill gets a KEEPALIVE every keepalive_s counted from the last frame it was sent, however
often the store wakes it for changes that are not its own (other entries opening, other streams' chunks): a busy
prefill must not starve a waiting decode of frames until its read timeout ends the pull."""

from __future__ import annotations

import asyncio

from pdserve.kv import KVMetrics, LeaseStore, SecretKey, pull

from .kvtestlib import make_layers, meta_for, running_server
from .test_kv_streaming import assert_same, raw, specs_of, store_of

READ_TIMEOUT_S = 0.6
KEEPALIVE_S = 0.2
BUSY_S = 2.0  # several read timeouts of changes that are not the waiting pull's
WAKE_EVERY_S = 0.05  # more often than KEEPALIVE_S: a keepalive timed from the last wake would never be sent
OPTIONS = {"connect_timeout_s": 2.0, "read_timeout_s": READ_TIMEOUT_S, "retries": 0, "backoff_s": 0.05}


async def open_others(store: LeaseStore, seconds: float) -> None:
    layers = make_layers(1, (2, 8), "float32")
    for index in range(int(seconds / WAKE_EVERY_S)):
        store.put(f"other-{index}", layers, meta_for(f"other-{index}"))
        await asyncio.sleep(WAKE_EVERY_S)


def test_a_pull_waiting_for_its_id_outlasts_a_busy_store(key: SecretKey, metrics: KVMetrics) -> None:
    layers = make_layers(2, (4, 64), "float32")
    store = store_of(metrics)

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics, open_wait_s=30.0, keepalive_s=KEEPALIVE_S) as server:
            pulling = asyncio.create_task(pull("127.0.0.1", server.port, "late", None, key=key, **OPTIONS))
            await open_others(store, BUSY_S)
            assert not pulling.done()
            store.put("late", layers, meta_for("late"))
            async with asyncio.timeout(30):
                assert_same(layers, (await pulling).layers)

    asyncio.run(scenario())


def test_a_stream_waiting_for_its_chunks_outlasts_other_streams_progress(key: SecretKey, metrics: KVMetrics) -> None:
    """Two streams; pieces for stream 0's chunks keep coming for BUSY_S while stream 1's chunk is not added."""
    layers = make_layers(1, (64, 1024), "float32")  # 256 KiB per array: 4 KiB wire chunks, 64 per array
    store = store_of(metrics)

    entry = store.open("slow", meta_for("slow"), specs_of(layers))

    async def fill() -> None:
        flat = [raw(array) for array in layers[0]]
        pieces = [(part, offset) for part in (0, 1) for offset in range(0, flat[part].size, 4096)]
        odd = [piece for index, piece in enumerate(pieces) if index % 2]  # stream 1's chunks (plan[1::2])
        even = [piece for index, piece in enumerate(pieces) if not index % 2]
        for part, offset in even:
            entry.add(0, part, offset, flat[part][offset : offset + 4096])
            await asyncio.sleep(BUSY_S / len(even))
        for part, offset in odd:
            entry.add(0, part, offset, flat[part][offset : offset + 4096])
        entry.seal()

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics, keepalive_s=KEEPALIVE_S) as server:
            async with asyncio.timeout(30):
                blob, _ = await asyncio.gather(
                    pull("127.0.0.1", server.port, "slow", None, key=key, streams=2, **OPTIONS), fill()
                )
            assert_same(layers, blob.layers)

    asyncio.run(scenario())
