"""Lease renewal and the store's hash threads: a long prefill keeps its streamed entry while it still adds to it,
and the connector can place the digest threads (their CPU affinity) away from the engine's forward thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pdserve.kv import KVTransferError, LeaseStore
from pdserve.kv.blob import ArraySpec

from .kvtestlib import meta_for

SPECS = ((ArraySpec(np.dtype(np.uint8).str, (4, 16)), ArraySpec(np.dtype(np.uint8).str, (0,))),)


def clocked_store(now: list[float], **options: object) -> LeaseStore:
    return LeaseStore(1 << 20, default_lease_s=5.0, clock=lambda: now[0], **options)  # type: ignore[arg-type]


def test_a_renewed_entry_outlives_its_first_lease() -> None:
    now = [100.0]
    store = clocked_store(now)
    store.open("long", meta_for("long"), SPECS, unit_rows=1)
    for _step in range(4):  # a prefill whose steps, together, take longer than one lease
        now[0] += 4.0
        assert store.renew("long")
        assert store.reap() == 0
    assert store.get("long").meta.request_id == "long"
    now[0] += 5.0
    assert store.reap() == 1
    with pytest.raises(KVTransferError) as refused:
        store.get("long")
    assert refused.value.cause == "expired"


def test_an_expired_or_unknown_entry_cannot_be_renewed() -> None:
    now = [0.0]
    store = clocked_store(now)
    store.open("short", meta_for("short"), SPECS, unit_rows=1)
    now[0] += 6.0
    store.reap()
    assert not store.renew("short")
    assert not store.renew("never-held")
    with pytest.raises(ValueError, match="lease_s"):
        store.renew("short", lease_s=0)


def test_hash_threads_run_the_initializer_first() -> None:
    started: list[str] = []
    store = LeaseStore(1 << 20, thread_initializer=lambda: started.append(threading.current_thread().name))
    stored = store.open("hashed", meta_for("hashed", token_count=64), SPECS, unit_rows=1)
    stored.add(0, 0, 0, np.arange(64, dtype=np.uint8))
    stored.seal()
    for _ in range(200):
        if stored.checksum:
            break
        threading.Event().wait(0.01)
    assert stored.checksum
    assert started and all(name.startswith("pdstack-kv-hash") for name in started)
