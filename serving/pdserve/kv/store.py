"""The prefill side's lease store: KV blobs held until decode acknowledges them or their lease expires."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.kv.blob import KVMeta, Layer, Manifest, build_manifest, validate_layers
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics

DEFAULT_CHUNK_BYTES = 1 << 20
FORGOTTEN_IDS_KEPT = 4096


@dataclass(frozen=True)
class StoredKV:
    manifest: Manifest
    layers: list[Layer]
    expires_at: float

    @property
    def checksum(self) -> str:
        return self.manifest.checksum

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes


class LeaseStore:
    """Holds KV under leases, within a byte capacity; thread-safe so an engine thread may `put`."""

    def __init__(
        self,
        capacity_bytes: int,
        default_lease_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        metrics: KVMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be positive, got {capacity_bytes}")
        if default_lease_s <= 0:
            raise ValueError(f"default_lease_s: must be positive, got {default_lease_s}")
        self.capacity_bytes = capacity_bytes
        self.default_lease_s = default_lease_s
        self.chunk_bytes = chunk_bytes
        self._metrics = metrics if metrics is not None else default_metrics()
        self._clock = clock
        self._entries: dict[str, StoredKV] = {}
        self._expired_ids: OrderedDict[str, None] = OrderedDict()
        self._bytes_held = 0
        self._lock = threading.Lock()
        self._reaper: asyncio.Task[None] | None = None

    @property
    def bytes_held(self) -> int:
        return self._bytes_held

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, request_id: str, layers: list[Layer], meta: KVMeta, lease_s: float | None = None) -> StoredKV:
        """Hold a blob under a lease and return it with the checksum decode must verify against."""
        if not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if meta.request_id != request_id:
            raise ValueError(f"meta.request_id {meta.request_id!r} differs from request_id {request_id!r}")
        lease = self.default_lease_s if lease_s is None else lease_s
        if lease <= 0:
            raise ValueError(f"lease_s: must be positive, got {lease}")
        checked = validate_layers(layers)
        manifest = build_manifest(meta, checked, self.chunk_bytes)
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"request_id {request_id!r}: KV for this request is already held")
            if self._bytes_held + manifest.nbytes > self.capacity_bytes:
                raise KVTransferError(
                    "capacity",
                    f"KV store full: holding {self._bytes_held} of {self.capacity_bytes} bytes, "
                    f"request {request_id!r} needs {manifest.nbytes}",
                )
            stored = StoredKV(manifest, checked, self._clock() + lease)
            self._entries[request_id] = stored
            self._bytes_held += manifest.nbytes
            self._update_gauges()
        return stored

    def get(self, request_id: str) -> StoredKV:
        with self._lock:
            stored = self._entries.get(request_id)
            if stored is not None and stored.expires_at <= self._clock():
                self._release(request_id, "expired")
                stored = None
            if stored is None:
                if request_id in self._expired_ids:
                    raise KVTransferError("expired", f"the lease on KV for request {request_id!r} expired")
                raise KVTransferError("not_found", f"no KV held for request {request_id!r}")
            return stored

    def ack(self, request_id: str) -> bool:
        """Free a blob once decode has it; False if it was not held (already acked or expired)."""
        with self._lock:
            if request_id not in self._entries:
                return False
            self._release(request_id, "ack")
            return True

    def reap(self) -> int:
        """Free every expired blob; return how many."""
        now = self._clock()
        with self._lock:
            expired = [rid for rid, stored in self._entries.items() if stored.expires_at <= now]
            for request_id in expired:
                self._release(request_id, "expired")
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
        stored = self._entries.pop(request_id)
        self._bytes_held -= stored.nbytes
        if reason == "expired":
            self._expired_ids[request_id] = None
            while len(self._expired_ids) > FORGOTTEN_IDS_KEPT:
                self._expired_ids.popitem(last=False)
        self._metrics.lease_released.labels(reason).inc()
        self._update_gauges()

    def _update_gauges(self) -> None:
        self._metrics.lease_bytes.set(self._bytes_held)
        self._metrics.leases.set(len(self._entries))
