"""Streamed lease entries over real loopback sockets: decode pulls KV while prefill is still adding it.

An entry is opened with its layout, filled from another thread (as vLLM's forward does, layer by layer and chunk by
chunk), then sealed; a pull gets every piece as soon as it is added, waits a bounded time for an id not opened yet,
and ends with a clear cause when the entry is never sealed.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv import KVBlob, KVMetrics, KVTransferError, Layer, LeaseStore, SecretKey, ack, pull
from pdserve.kv.blob import ArraySpec
from pdserve.kv.entry import StoredKV

from .kvtestlib import address, make_layers, meta_for, proxy_to, running_server

FAST = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "retries": 1, "backoff_s": 0.05}
STEP_WAIT_S = 10.0  # how long the adding thread waits for decode to have received a piece before failing


def store_of(metrics: KVMetrics, **options: float) -> LeaseStore:
    return LeaseStore(capacity_bytes=64 << 20, chunk_bytes=4096, metrics=metrics, **options)  # type: ignore[arg-type]


def specs_of(layers: list[Layer]) -> tuple[tuple[ArraySpec, ArraySpec], ...]:
    return tuple((ArraySpec.of(k), ArraySpec.of(v)) for k, v in layers)


def raw(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def assert_same(sent: list[Layer], got: list[Layer]) -> None:
    assert len(got) == len(sent)
    for (k, v), (k2, v2) in zip(sent, got, strict=True):
        assert k2.shape == k.shape and k2.tobytes() == k.tobytes()
        assert v2.shape == v.shape and v2.tobytes() == v.tobytes()


class Received:
    """How many bytes a proxy has passed to decode so far, waited on from another thread."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def forwarded(self, total: int) -> None:
        with self._changed:
            self.count = total
            self._changed.notify_all()

    def wait_for(self, nbytes: int) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self.count >= nbytes, STEP_WAIT_S):
                raise AssertionError(f"decode got {self.count} bytes, expected {nbytes} before the next piece")


def fill_in_lockstep(entry: StoredKV, pieces: list[tuple[int, int, int, np.ndarray]], received: Received) -> None:
    """Add each piece only once decode has received every byte added before it (the entry is never sealed until
    the end): a server that held pieces back until the seal would leave this thread waiting, and the test fails."""
    added = 0
    for layer, part, offset, data in pieces:
        entry.add(layer, part, offset, data)
        added += data.nbytes
        received.wait_for(added)
    entry.seal()


def layer_pieces(layers: list[Layer]) -> list[tuple[int, int, int, np.ndarray]]:
    return [(index, part, 0, raw(array)) for index, pair in enumerate(layers) for part, array in enumerate(pair)]


def chunked_pieces(layers: list[Layer], chunks: int) -> list[tuple[int, int, int, np.ndarray]]:
    """Chunked prefill's order: every layer of prompt chunk 0, then every layer of chunk 1, ... (byte ranges; the
    caller picks sizes whose pieces are whole wire chunks, as block-aligned prompt chunks are)."""
    pieces = []
    for chunk in range(chunks):
        for index, pair in enumerate(layers):
            for part, array in enumerate(pair):
                flat = raw(array)
                step = -(-flat.size // chunks)
                piece = flat[chunk * step : (chunk + 1) * step]
                if piece.size:
                    pieces.append((index, part, chunk * step, piece))
    return pieces


def streamed_pull(
    key: SecretKey,
    metrics: KVMetrics,
    layers: list[Layer],
    streams: int,
    pieces: Callable[[list[Layer]], list[tuple[int, int, int, np.ndarray]]],
) -> None:
    store = store_of(metrics)
    whole = store_of(metrics).put("req-s", layers, meta_for("req-s"))  # the checksum a whole blob would have
    received = Received()

    async def scenario() -> None:
        async with (
            running_server(store, key, metrics=metrics) as server,
            proxy_to(server.port, on_forward=received.forwarded) as proxy,
        ):
            entry = store.open("req-s", meta_for("req-s"), specs_of(layers))
            assert entry.manifest.checksum == ""  # not known until sealed
            async with asyncio.timeout(60):
                blob, _ = await asyncio.gather(
                    pull("127.0.0.1", proxy.port, "req-s", None, key=key, streams=streams, metrics=metrics, **FAST),
                    asyncio.to_thread(fill_in_lockstep, entry, pieces(layers), received),
                )
            assert entry.checksum == whole.checksum
            assert_same(layers, blob.layers)
            assert await ack("127.0.0.1", server.port, "req-s", key=key)

    asyncio.run(scenario())
    assert store.bytes_held == 0


@pytest.mark.parametrize("streams", [1, 3])
def test_each_layer_reaches_decode_as_soon_as_it_is_added(key: SecretKey, metrics: KVMetrics, streams: int) -> None:
    streamed_pull(key, metrics, make_layers(5, (8, 300), "float16", seed=streams), streams, layer_pieces)


def test_chunked_prefill_pieces_reach_decode_as_soon_as_they_are_added(key: SecretKey, metrics: KVMetrics) -> None:
    streamed_pull(key, metrics, make_layers(4, (3, 4096), "float32"), 2, lambda layers: chunked_pieces(layers, 3))


def test_a_pull_sent_before_prefill_opens_the_entry_waits_for_it(key: SecretKey, metrics: KVMetrics) -> None:
    layers = make_layers(3, (16, 16), "float32")
    store = store_of(metrics)

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics, open_wait_s=30.0, keepalive_s=0.05) as server:
            pulling = asyncio.create_task(pull("127.0.0.1", server.port, "late", None, key=key, streams=2, **FAST))
            await asyncio.sleep(0.3)  # decode asked first; several keepalives pass
            assert not pulling.done()
            stored = store.put("late", layers, meta_for("late"))
            async with asyncio.timeout(30):
                blob = await pulling
            assert_same(layers, blob.layers)
            assert stored.checksum

    asyncio.run(scenario())


def test_a_pull_for_an_id_never_opened_ends_not_found(key: SecretKey, metrics: KVMetrics) -> None:
    store = store_of(metrics)

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics, open_wait_s=0.3, keepalive_s=0.05) as server:
            with pytest.raises(KVTransferError) as caught:
                await pull("127.0.0.1", server.port, "never", None, key=key, **FAST)
            assert caught.value.cause == "not_found"

    asyncio.run(scenario())


def test_an_entry_never_sealed_ends_its_pulls_and_is_reaped(key: SecretKey, metrics: KVMetrics) -> None:
    layers = make_layers(3, (16, 16), "float32")
    store = store_of(metrics, default_lease_s=0.5)

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics, keepalive_s=0.05) as server:
            store.start_reaper(interval_s=0.05)
            entry = store.open("stuck", meta_for("stuck"), specs_of(layers))
            entry.add(0, 0, 0, raw(layers[0][0]))  # prefill died after the first piece
            with pytest.raises(KVTransferError, match="before prefill completed it") as caught:
                await pull("127.0.0.1", server.port, "stuck", None, key=key, streams=2, **FAST)
            assert caught.value.cause == "expired"
            await store.stop_reaper()

    asyncio.run(scenario())
    assert store.bytes_held == 0 and len(store) == 0


def test_an_aborted_entry_ends_its_pulls_at_once(key: SecretKey, metrics: KVMetrics) -> None:
    layers = make_layers(2, (16, 16), "float32")
    store = store_of(metrics)

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics, open_wait_s=5.0) as server:
            store.open("gone", meta_for("gone"), specs_of(layers))
            pulling = asyncio.create_task(pull("127.0.0.1", server.port, "gone", None, key=key, **FAST))
            await asyncio.sleep(0.2)
            assert store.abort("gone", "prefill aborted the request")
            # Whether the pull was already waiting for data or arrives after the abort, it ends at once.
            with pytest.raises(KVTransferError, match="prefill aborted") as caught:
                await pulling
            assert caught.value.cause == "not_found"
            # Asked again, an id whose KV is gone fails without waiting for it to be opened.
            with pytest.raises(KVTransferError, match="prefill aborted it"):
                await pull("127.0.0.1", server.port, "gone", None, key=key, **FAST)

    asyncio.run(scenario())
    assert store.bytes_held == 0


def test_a_pull_checks_the_checksum_it_was_given_against_the_stream(key: SecretKey, metrics: KVMetrics) -> None:
    layers = make_layers(2, (16, 16), "float32")
    store = store_of(metrics)

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            entry = store.open("x", meta_for("x"), specs_of(layers))
            for layer, part, offset, data in layer_pieces(layers):
                entry.add(layer, part, offset, data)
            pulling = pull("127.0.0.1", server.port, "x", "sha256:" + "0" * 64, key=key, **FAST)
            entry.seal()
            with pytest.raises(KVTransferError) as caught:
                await pulling
            assert caught.value.cause == "checksum"

    asyncio.run(scenario())


def test_put_replace_swaps_the_blob_and_a_duplicate_is_refused(metrics: KVMetrics) -> None:
    store = store_of(metrics)
    first = store.put("r", make_layers(2, (8, 8), "float32", seed=1), meta_for("r"))
    with pytest.raises(ValueError, match="already held"):
        store.put("r", make_layers(2, (8, 8), "float32", seed=2), meta_for("r"))
    second = store.put("r", make_layers(2, (16, 8), "float32", seed=2), meta_for("r"), replace=True)
    assert store.get("r") is second and second.checksum != first.checksum
    assert store.bytes_held == second.nbytes and len(store) == 1


def test_seal_and_add_name_what_is_wrong(metrics: KVMetrics) -> None:
    layers = make_layers(2, (4, 4), "float32")
    entry = store_of(metrics).open("e", meta_for("e"), specs_of(layers))
    entry.add(0, 0, 0, raw(layers[0][0]))
    with pytest.raises(ValueError, match="layer 0 is not complete"):
        entry.seal()
    with pytest.raises(ValueError, match="layer 0 part 1 holds 64 bytes"):
        entry.add(0, 1, 32, raw(layers[0][1]))
    with pytest.raises(ValueError, match="layer 7, part 0"):
        entry.add(7, 0, 0, raw(layers[0][1]))
    for layer, part, offset, data in layer_pieces(layers):
        entry.add(layer, part, offset, data)
    entry.seal()
    with pytest.raises(ValueError, match="sealed"):
        entry.add(0, 0, 0, raw(layers[0][0]))


def test_write_fills_the_blob_in_place(metrics: KVMetrics) -> None:
    """An engine gathers its blocks straight into the blob (StoredKV.write): the blob a whole put would hold, under
    the same checks as add."""
    layers = make_layers(2, (4, 4), "float32", seed=3)
    whole = store_of(metrics).put("w", layers, meta_for("w"))
    written = store_of(metrics).open("w", meta_for("w"), specs_of(layers))
    for layer, part, offset, data in layer_pieces(layers):

        def fill(target: memoryview, data: np.ndarray = data) -> None:
            np.frombuffer(target, np.uint8)[:] = data

        written.write(layer, part, offset, len(data), fill)
    with pytest.raises(ValueError, match="layer 0 part 1 holds 64 bytes"):
        written.write(0, 1, 32, 64, lambda target: None)
    written.seal()
    with written.watch() as changed:  # the last digests are computed on the store's hash threads
        while not written.checksum:
            assert changed.wait(STEP_WAIT_S), "no checksum followed the seal"
    assert written.checksum == whole.checksum
    assert_same(layers, written.layers)
    with pytest.raises(ValueError, match="sealed"):
        written.write(0, 0, 0, 4, lambda target: None)


def test_an_acknowledged_entry_is_freed_at_once_and_the_next_one_lands_in_its_memory(
    key: SecretKey, metrics: KVMetrics
) -> None:
    """Prefill gathers each layer into its entry on the forward's thread, where a fresh page is a fault. Once decode
    has pulled and acknowledged an entry, nothing of the store, the KV server or the pull's shared plan refers to it
    any more (no reference cycle waits for the garbage collector, which vLLM runs rarely): the next entry of its size
    lands in its memory, already faulted in. An entry something still refers to is never reused."""
    layers = make_layers(4, (64, 2048), "float32", seed=5)  # 4 MiB: one reusable mapping
    store = store_of(metrics)

    async def pulled_and_acknowledged(request_id: str) -> tuple[weakref.ref[StoredKV], int, KVBlob]:
        async with running_server(store, key, metrics=metrics) as server:
            entry = store.open(request_id, meta_for(request_id), specs_of(layers))
            for layer, part, offset, data in layer_pieces(layers):
                entry.add(layer, part, offset, data)
            entry.seal()
            blob = await pull("127.0.0.1", server.port, request_id, None, key=key, streams=2, metrics=metrics, **FAST)
            assert await ack("127.0.0.1", server.port, request_id, key=key)
            return weakref.ref(entry), address(entry.layers[0][0]), blob  # the blob keeps the pull's own mapping in use

    gc.disable()
    try:
        entry, first_address, _blob = asyncio.run(pulled_and_acknowledged("a"))
        assert entry() is None, gc.get_referrers(entry())
        held = store.open("b", meta_for("b"), specs_of(layers))
        assert address(held.layers[0][0]) == first_address
        assert address(store.open("c", meta_for("c"), specs_of(layers)).layers[0][0]) != address(held.layers[0][0])
    finally:
        gc.enable()


class CountingMetrics(KVMetrics):
    """What a KVMetrics subclass sees through the public observe_* hooks."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self.released: list[str] = []
        self.held: list[tuple[int, int]] = []

    def observe_lease_released(self, reason: str) -> None:
        super().observe_lease_released(reason)
        self.released.append(reason)

    def observe_leases(self, nbytes: int, count: int) -> None:
        super().observe_leases(nbytes, count)
        self.held.append((nbytes, count))


def test_lease_events_reach_a_metrics_subclass_through_public_hooks() -> None:
    metrics = CountingMetrics()
    store = LeaseStore(1 << 20, default_lease_s=30.0, metrics=metrics)
    stored = store.put("a", make_layers(1, (4, 4), "float32"), meta_for("a"))
    store.open("b", meta_for("b"), stored.specs)
    store.put("a", make_layers(1, (4, 4), "float32", seed=3), meta_for("a"), replace=True)
    store.ack("a")
    store.abort("b", "test")
    assert metrics.released == ["replaced", "ack", "aborted"]
    assert metrics.held[0] == (stored.nbytes, 1) and metrics.held[-1] == (0, 0)
