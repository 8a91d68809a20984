"""Reusable arrays for KV blobs: where a pull's bytes land on decode (the stream threads receive DATA straight into
them, one copy from the kernel) and where prefill's engine gathers a streamed lease entry (`StoredKV`) during its
forward.

A big blob's arrays share one anonymous mapping. Fresh memory is expensive here: the kernel zeroes and faults in
every page on first touch (with transparent huge pages it may also compact memory first), which cost more CPU than
receiving the bytes, and on prefill it lands on the forward's thread. So a mapping whose arrays are all gone (every
view of them garbage) goes back to a bounded set of idle mappings, and a later blob of the same size, or smaller by
up to half, reuses it, already faulted in (prompt lengths vary, so exact sizes rarely repeat). Mappings are made in
whole huge pages for the same reason.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections.abc import Iterable

import numpy as np

from pdserve.kv.blob import ArraySpec, Layer

HUGE_PAGE_BYTES = 2 << 20
ALIGN = 64
IDLE_REGION_BYTES = 1 << 30  # idle mappings kept for later blobs, over all sizes
REUSE_SLACK = 2  # a blob may land in an idle mapping up to this many times its size (the rest stays idle)


class _Regions:
    """Idle destination mappings by size, at most `limit` bytes of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._idle: dict[int, list[mmap.mmap]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        """An idle mapping of at least `size` bytes and at most REUSE_SLACK times that (the smallest such), else a
        new one of `size` rounded up to whole huge pages."""
        with self._lock:
            fits = [length for length in self._idle if size <= length <= size * REUSE_SLACK and self._idle[length]]
            if fits:
                length = min(fits)
                self._bytes -= length
                return self._idle[length].pop()
        size = -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # THP disabled: plain pages
                region.madvise(advice)
        return region

    def give_back(self, region: mmap.mmap) -> None:
        with self._lock:
            if self._bytes + len(region) <= self.limit:
                self._idle.setdefault(len(region), []).append(region)
                self._bytes += len(region)

    @property
    def idle_bytes(self) -> int:
        return self._bytes


REGIONS = _Regions(IDLE_REGION_BYTES)


def kv_arrays(specs: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """Arrays of these (shape, dtype), for a blob being received or gathered; their bytes are undefined until written
    (a reused mapping holds an earlier blob's).

    A big blob's arrays share one anonymous mapping, reused from an earlier blob of the same size or up to
    REUSE_SLACK times larger when one is idle, else new and advised for transparent huge pages (the kernel then
    faults its memory in 2 MiB pages as bytes land instead of 4 KiB ones, which on this kind of machine costs less
    than a tenth)."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    if total < HUGE_PAGE_BYTES:
        return [np.empty(shape, np.dtype(dtype)) for shape, dtype in specs]
    region = REGIONS.take(total)
    # numpy makes every view's base the array it was cut from: once `whole` is collected, no array of this blob (nor
    # any view of one) is left, and the mapping is free again.
    whole = np.frombuffer(region, np.uint8)
    weakref.finalize(whole, REGIONS.give_back, region)
    return [
        whole[offset : offset + size].view(np.dtype(dtype)).reshape(shape)
        for (shape, dtype), offset, size in zip(specs, offsets, sizes, strict=True)
    ]


def kv_layers(specs: Iterable[tuple[ArraySpec, ArraySpec]]) -> list[Layer]:
    """Each layer's (K, V) arrays for these specs, as `kv_arrays` makes them."""
    arrays = kv_arrays([(spec.shape, spec.dtype) for pair in specs for spec in pair])
    return [(arrays[i], arrays[i + 1]) for i in range(0, len(arrays), 2)]
