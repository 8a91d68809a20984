"""One KV blob in the lease store, whole or still being written: its layout, its bytes, what of them is in.

A whole blob (`LeaseStore.put`) is born complete and sealed. A streamed one (`LeaseStore.open`) is born with its
layout (so its manifest can be sent at once) and empty arrays; an engine thread adds pieces (a byte range of one
layer's K or V) as they are computed and seals it when the prompt is complete. Each layer's digest is computed off
the adding thread as soon as the layer is whole; the blob checksum once it is sealed and every digest is in.

Pulls run on the KV server's connection threads: they hold a `watch()`, look, and wait on it before looking again.
Every change (a piece, the seal, the checksum, an abort) sets every watch (a threading.Event: a futex wake, where an
event loop per waiting thread cost a self-pipe write, an epoll wake and a loop turn, on the core prefill's forward
runs on); a watch is registered before the look, so no change between the look and the wait is missed.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np

from pdserve.kv.arrays import kv_layers
from pdserve.kv.blob import ArraySpec, KVMeta, Layer, Manifest, Units, as_bytes, blob_checksum, flat_views, unit_digests
from pdserve.kv.errors import Cause, KVTransferError

LayerSpecs = tuple[tuple[ArraySpec, ArraySpec], ...]


class _Ranges:
    """Filled byte ranges of one array, kept merged and sorted."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        low = bisect.bisect_left(self._ends, start)  # first range ending at or after start
        high = bisect.bisect_right(self._starts, end)  # ranges starting after end are untouched
        if low < high:
            start, end = min(start, self._starts[low]), max(end, self._ends[high - 1])
        self._starts[low:high] = [start]
        self._ends[low:high] = [end]

    def covers(self, start: int, end: int) -> bool:
        if start >= end:
            return True
        index = bisect.bisect_right(self._starts, start) - 1
        return index >= 0 and self._ends[index] >= end

    @property
    def full(self) -> bool:
        return self.covers(0, self.size)


class Watchers:
    """Watches to set on a change, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()

    def add(self, watch: Watch) -> None:
        with self._lock:
            self._watches.add(watch)

    def discard(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def wake(self) -> None:
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.event.set()


class Watch:
    """Set on every change after it was made, from any thread; use it as a context manager, and wait on it."""

    def __init__(self, watchers: Watchers) -> None:
        self.event = threading.Event()
        self._watchers = watchers

    def __enter__(self) -> Watch:
        self._watchers.add(self)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._watchers.discard(self)

    def wait(self, timeout: float) -> bool:
        """Block until something changed since the last wait (or since the watch began): True; False after
        `timeout`. A change between the wake and the clear is not lost: the caller looks after this returns."""
        if not self.event.wait(timeout):
            return False
        self.event.clear()
        return True


class StoredKV:
    """A blob held under a lease; thread-safe (the engine adds, the KV server's connection threads read)."""

    def __init__(
        self,
        meta: KVMeta,
        specs: LayerSpecs,
        chunk_bytes: int,
        expires_at: float,
        *,
        unit_rows: int = 0,
        hasher: Executor | None = None,
        layers: list[Layer] | None = None,
    ) -> None:
        self.meta = meta
        self.specs = specs
        self.chunk_bytes = chunk_bytes
        self.unit_rows = unit_rows
        self.units = Units(specs, unit_rows)
        self.expires_at = expires_at
        self.layers: list[Layer] = layers if layers is not None else kv_layers(specs)
        self._views = flat_views(self.layers)
        self._filled = [_Ranges(len(view)) for view in self._views]
        self._digests: list[bytes | None] = [None] * self.units.total
        self._hashing = [False] * self.units.total
        self._hasher = hasher
        self._lock = threading.Lock()
        self._watchers = Watchers()
        self.sealed = False
        self.sent_unsealed = 0  # bytes the KV server sent before the seal (decode had them while prefill computed)
        self.checksum = ""  # known once sealed and every unit hashed
        self.failure: KVTransferError | None = None
        if layers is not None:  # a whole blob: everything is in
            for ranges in self._filled:
                ranges.add(0, ranges.size)
            self._digests = list(unit_digests(self._views, self.units, range(self.units.total)))
            self.sealed = True
            self._finish_if_done()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.specs)

    @property
    def manifest(self) -> Manifest:
        """The manifest as of now: its checksum is "" until the blob is sealed and hashed (END then carries it)."""
        return Manifest(self.meta, self.specs, self.chunk_bytes, self.checksum, self.unit_rows)

    @property
    def digests(self) -> bytes:
        """Every unit's digest, in order (complete once `checksum` is set)."""
        with self._lock:
            return b"".join(digest or b"" for digest in self._digests)

    def add(self, layer: int, part: int, offset: int, data: np.ndarray | bytes | memoryview) -> None:
        """Copy `data` into bytes [offset, offset + len) of layer `layer`'s K (part 0) or V (part 1)."""
        raw = as_bytes(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else memoryview(data).cast("B")

        def copy(target: memoryview) -> None:
            target[:] = raw

        self.write(layer, part, offset, len(raw), copy)

    def write(self, layer: int, part: int, offset: int, length: int, fill: Callable[[memoryview], None]) -> None:
        """Let `fill` write bytes [offset, offset + length) of layer `layer`'s K (part 0) or V (part 1) in place, then
        count them in: an engine gathers its KV blocks straight into the blob, with no buffer (and no page faults
        on a fresh one, each request) between."""
        if not 0 <= layer < len(self.specs) or part not in (0, 1):
            raise ValueError(f"layer {layer}, part {part}: the blob has {len(self.specs)} layers of parts 0 (K), 1 (V)")
        array = 2 * layer + part
        view = self._views[array]
        if offset < 0 or length < 0 or offset + length > len(view):
            raise ValueError(f"offset {offset} + {length} bytes: layer {layer} part {part} holds {len(view)} bytes")
        with self._lock:
            if self.sealed or self.failure is not None:
                raise ValueError(f"request {self.meta.request_id!r}: its KV is sealed or aborted, nothing may be added")
            fill(view[offset : offset + length])
            self._filled[array].add(offset, offset + length)
            complete = [
                unit
                for unit in self.units.covering(array, offset, offset + length)
                if not self._hashing[unit] and self._filled[array].covers(*self.units.span(unit)[1:])
            ]
            for unit in complete:
                self._hashing[unit] = True
        if complete:
            self._hash_units(complete)
        self._wake()

    def seal(self) -> None:
        """Every byte is in (ValueError naming the first missing layer otherwise); the checksum follows."""
        with self._lock:
            missing = [index for index, ranges in enumerate(self._filled) if not ranges.full]
            if missing:
                raise ValueError(
                    f"request {self.meta.request_id!r}: layer {missing[0] // 2} is not complete, cannot seal"
                )
            self.sealed = True
        self._finish_if_done()
        self._wake()

    def fail(self, cause: Cause, message: str) -> None:
        """End every pull of this blob with `cause` (prefill aborted it, its lease ran out unsealed, or it was
        replaced); a blob already complete keeps serving the pulls under way."""
        with self._lock:
            if self.failure is None and not self.checksum:
                self.failure = KVTransferError(cause, message)
        self._wake()

    def ready(self, layer: int, part: int, offset: int, length: int) -> bool:
        with self._lock:
            return self._filled[2 * layer + part].covers(offset, offset + length)

    def count_sent(self, length: int) -> None:
        """The KV server sent `length` bytes of this blob (counted in `sent_unsealed` if it is not sealed yet)."""
        with self._lock:
            if not self.sealed:
                self.sent_unsealed += length

    def check(self) -> None:
        """Raise the failure that ended this blob, if any."""
        if self.failure is not None:
            raise self.failure

    def watch(self) -> Watch:
        """A Watch set by every later change (a piece, the seal, the checksum, a failure)."""
        return Watch(self._watchers)

    def _wake(self) -> None:
        self._watchers.wake()

    def _hash_units(self, units: list[int]) -> None:
        if self._hasher is None:
            self._store_digests(units, unit_digests(self._views, self.units, units))
            return
        future = self._hasher.submit(unit_digests, self._views, self.units, units)
        future.add_done_callback(lambda done: self._digests_done(units, done))

    def _digests_done(self, units: list[int], done: Future[list[bytes]]) -> None:
        error = done.exception()
        if error is not None:
            self.fail("protocol", f"hashing KV units failed: {error!r}")
            return
        self._store_digests(units, done.result())
        self._wake()

    def _store_digests(self, units: list[int], digests: list[bytes]) -> None:
        with self._lock:
            for unit, digest in zip(units, digests, strict=True):
                self._digests[unit] = digest
        self._finish_if_done()

    def _finish_if_done(self) -> None:
        with self._lock:
            if not self.sealed or self.checksum or any(d is None for d in self._digests):
                return
            digests: list[Any] = list(self._digests)
            self.checksum = blob_checksum(self.meta, self.specs, self.unit_rows, digests)
