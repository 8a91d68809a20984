"""Where a pull's bytes land: the destination arrays the stream threads receive DATA into (pdserve.kv.wire reads
each payload straight into its slice, one copy from the kernel)."""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

HUGE_PAGE_BYTES = 2 << 20
ALIGN = 64


def destination_arrays(specs: list[tuple[tuple[int, ...], str]]) -> list[np.ndarray]:
    """Empty arrays of these (shape, dtype), for a blob being received.

    A big blob's arrays share one anonymous mapping advised for transparent huge pages: the kernel then faults its
    memory in 2 MiB pages as bytes land instead of 4 KiB ones, which on this kind of machine costs less than a tenth
    (the first touch of fresh memory was the largest single cost of a cold pull)."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if total < HUGE_PAGE_BYTES or advice is None:
        return [np.empty(shape, np.dtype(dtype)) for shape, dtype in specs]
    region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP disabled: plain pages
        region.madvise(advice)
    return [np.frombuffer(region, np.dtype(dtype), int(np.prod(shape)), offset).reshape(shape)
            for (shape, dtype), offset in zip(specs, offsets, strict=True)]
