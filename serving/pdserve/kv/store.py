"""The prefill side's lease store: KV blobs held until decode acknowledges them or their lease expires.

A blob goes in whole (`put`), or streamed (`open` with its layout, then `StoredKV.add` from the engine's thread as
layers are computed, then `StoredKV.seal`). A streamed blob whose lease runs out before it is sealed is reaped like
any other, and the pulls streaming it end with cause "expired"; `abort` ends them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from pdserve.kv.blob import ArraySpec, KVMeta, Layer, validate_layers
from pdserve.kv.entry import LayerSpecs, StoredKV, Watch, Watchers
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics

DEFAULT_CHUNK_BYTES = 1 << 20
FORGOTTEN_IDS_KEPT = 4096


class LeaseStore:
    """Holds KV under leases, within a byte capacity; thread-safe so an engine thread may `put`."""

    def __init__(
        self,
        capacity_bytes: int,
        default_lease_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        metrics: KVMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        hash_threads: int = 2,
        thread_initializer: Callable[[], None] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be positive, got {capacity_bytes}")
        if default_lease_s <= 0:
            raise ValueError(f"default_lease_s: must be positive, got {default_lease_s}")
        self.capacity_bytes = capacity_bytes
        self.default_lease_s = default_lease_s
        self.chunk_bytes = chunk_bytes
        self._metrics = metrics if metrics is not None else default_metrics()
        self.clock = clock
        self.hash_threads = hash_threads
        self._thread_initializer = thread_initializer  # run first on each hash thread (e.g. its CPU affinity)
        self._entries: dict[str, StoredKV] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # released ids -> why (ack, expired, aborted)
        self._watchers = Watchers()
        self._hash_pool: ThreadPoolExecutor | None = None
        self._bytes_held = 0
        self._lock = threading.Lock()
        self._reaper: asyncio.Task[None] | None = None

    @property
    def bytes_held(self) -> int:
        return self._bytes_held

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        request_id: str,
        layers: list[Layer],
        meta: KVMeta,
        lease_s: float | None = None,
        *,
        replace: bool = False,
        unit_rows: int = 0,
    ) -> StoredKV:
        """Hold a whole blob under a lease and return it with the checksum decode must verify against.

        With `replace`, a blob already held for `request_id` is dropped first (a request prefilled again).
        `unit_rows` > 0 digests each array's leading rows that many at a time (blocks), so ranges can be pulled."""
        lease = self._check_ids(request_id, meta, lease_s)
        checked = validate_layers(layers)
        specs = tuple((ArraySpec.of(k), ArraySpec.of(v)) for k, v in checked)
        stored = StoredKV(meta, specs, self.chunk_bytes, self.clock() + lease, unit_rows=unit_rows, layers=checked)
        return self._hold(request_id, stored, replace)

    def open(
        self,
        request_id: str,
        meta: KVMeta,
        specs: LayerSpecs,
        lease_s: float | None = None,
        *,
        replace: bool = False,
        unit_rows: int = 0,
    ) -> StoredKV:
        """Hold an empty blob of this layout under a lease; add its pieces, then seal it (see StoredKV).

        Its bytes count against the capacity from now on; pulls of it may start at once."""
        lease = self._check_ids(request_id, meta, lease_s)
        if not specs:
            raise ValueError("specs: a KV blob needs at least one layer")
        stored = StoredKV(
            meta, tuple(specs), self.chunk_bytes, self.clock() + lease, unit_rows=unit_rows, hasher=self._hasher()
        )
        return self._hold(request_id, stored, replace)

    def renew(self, request_id: str, lease_s: float | None = None) -> bool:
        """Restart a held blob's lease from now (a long prefill still adding to it, or just sealed: the lease then
        counts from the seal); False if it is not held."""
        lease = self._lease(lease_s)
        with self._lock:
            stored = self._entries.get(request_id)
            if stored is None or stored.failure is not None:
                return False
            stored.expires_at = max(stored.expires_at, self.clock() + lease)
            return True

    def abort(self, request_id: str, message: str) -> bool:
        """Drop a blob that will never be complete; pulls streaming it end with cause "not_found" and `message`."""
        with self._lock:
            stored = self._entries.get(request_id)
            if stored is None:
                return False
            self._release(request_id, "aborted")
        stored.fail("not_found", message)
        return True

    def _check_ids(self, request_id: str, meta: KVMeta, lease_s: float | None) -> float:
        if not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if meta.request_id != request_id:
            raise ValueError(f"meta.request_id {meta.request_id!r} differs from request_id {request_id!r}")
        return self._lease(lease_s)

    def _lease(self, lease_s: float | None) -> float:
        lease = self.default_lease_s if lease_s is None else lease_s
        if lease <= 0:
            raise ValueError(f"lease_s: must be positive, got {lease}")
        return lease

    def _hold(self, request_id: str, stored: StoredKV, replace: bool) -> StoredKV:
        with self._lock:
            old = self._entries.get(request_id)
            if old is not None and not replace:
                raise ValueError(f"request_id {request_id!r}: KV for this request is already held")
            freed = old.nbytes if old is not None else 0
            if self._bytes_held - freed + stored.nbytes > self.capacity_bytes:
                raise KVTransferError(
                    "capacity",
                    f"KV store full: holding {self._bytes_held} of {self.capacity_bytes} bytes, "
                    f"request {request_id!r} needs {stored.nbytes}",
                )
            if old is not None:
                self._release(request_id, "replaced")
            self._gone.pop(request_id, None)
            self._entries[request_id] = stored
            self._bytes_held += stored.nbytes
            self._update_gauges()
        if old is not None:
            old.fail("not_found", f"the KV of request {request_id!r} was replaced by a newer prefill of it")
        self._wake()
        return stored

    def _hasher(self) -> Executor:
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(
                self.hash_threads, thread_name_prefix="pdstack-kv-hash", initializer=self._thread_initializer
            )
        return self._hash_pool

    def get(self, request_id: str) -> StoredKV:
        with self._lock:
            stored = self._entries.get(request_id)
            if stored is not None and stored.expires_at <= self.clock():
                self._release(request_id, "expired")
                stored.fail("expired", _unsealed_message(request_id))
                stored = None
            if stored is None:
                self._raise_gone(request_id)
            assert stored is not None
            return stored

    def watch(self) -> Watch:
        """A Watch set whenever a blob is opened or put (a pull waiting for an id not yet there)."""
        return Watch(self._watchers)

    def gone(self, request_id: str) -> bool:
        """Whether a blob was held for this id and released since (acknowledged, expired, aborted)."""
        with self._lock:
            return request_id in self._gone

    def _raise_gone(self, request_id: str) -> None:
        reason = self._gone.get(request_id)
        if reason == "expired":
            raise KVTransferError("expired", f"the lease on KV for request {request_id!r} expired")
        if reason is not None:
            said = {"ack": "decode acknowledged it", "aborted": "prefill aborted it"}.get(reason, reason)
            raise KVTransferError("not_found", f"the KV for request {request_id!r} is no longer held ({said})")
        raise KVTransferError("not_found", f"no KV held for request {request_id!r}")

    def _wake(self) -> None:
        self._watchers.wake()

    def ack(self, request_id: str) -> bool:
        """Free a blob once decode has it; False if it was not held (already acked or expired)."""
        with self._lock:
            if request_id not in self._entries:
                return False
            self._release(request_id, "ack")
            return True

    def reap(self) -> int:
        """Free every expired blob; return how many."""
        now = self.clock()
        with self._lock:
            expired = [(rid, stored) for rid, stored in self._entries.items() if stored.expires_at <= now]
            for request_id, _stored in expired:
                self._release(request_id, "expired")
        for request_id, stored in expired:
            stored.fail("expired", _unsealed_message(request_id))
        return len(expired)

    def start_reaper(self, interval_s: float = 1.0) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(interval_s))

    async def stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def _reap_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.reap()

    def _release(self, request_id: str, reason: str) -> None:
        """Drop an entry (lock held); remember why, so a later pull of it fails at once instead of waiting."""
        stored = self._entries.pop(request_id)
        self._bytes_held -= stored.nbytes
        if reason != "replaced":
            self._gone[request_id] = reason
            while len(self._gone) > FORGOTTEN_IDS_KEPT:
                self._gone.popitem(last=False)
        self._metrics.observe_lease_released(reason)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self._metrics.observe_leases(self._bytes_held, len(self._entries))


def _unsealed_message(request_id: str) -> str:
    return (
        f"the lease on KV for request {request_id!r} expired before prefill completed it (prefill failed or "
        "was aborted)"
    )
