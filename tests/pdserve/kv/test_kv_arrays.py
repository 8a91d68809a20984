"""Reusable KV arrays (pdserve.kv.arrays): where a pull lands and where a streamed lease entry is gathered. A
mapping is reused only once nothing refers to it, so no earlier blob's bytes can change under a caller."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from pdserve.kv.arrays import kv_arrays

from .kvtestlib import address


def test_big_destinations_are_separate_writable_arrays_of_the_asked_layout() -> None:
    specs = [((3, 1 << 18), "float16"), ((5, 7), "int8"), ((1 << 20,), "float32")]
    arrays = kv_arrays(specs)
    for array, (shape, dtype) in zip(arrays, specs, strict=True):
        assert array.shape == shape and array.dtype == dtype and array.flags.writeable
        array[...] = 1
    assert all((array == 1).all() for array in arrays)


@pytest.mark.slow  # maps and pulls a large block (about 1 s)
def test_a_destination_mapping_is_reused_only_once_no_view_of_its_arrays_is_left() -> None:
    specs = [((1 << 20,), "float32"), ((1 << 20,), "float32")]  # 8 MiB: one shared mapping

    first = kv_arrays(specs)
    first_address = address(first[0])
    first[1][:] = 3.0
    kept = first[1][5:9]  # a caller still holds a view of the first pull's KV
    del first
    gc.collect()
    second = kv_arrays(specs)
    assert address(second[0]) != first_address
    second[1][:] = 4.0
    assert (kept == 3.0).all()  # untouched by the second pull
    del kept
    gc.collect()
    third = kv_arrays(specs)
    assert address(third[0]) == first_address  # free again: reused, no fresh pages to fault in
    assert address(second[0]) != address(third[0])


def test_a_smaller_pull_reuses_an_idle_bigger_mapping_up_to_twice_its_size() -> None:
    """Prompt lengths vary: a pull of 5 MiB after one of 8 MiB lands in the 8 MiB mapping, already faulted in; one of
    3 MiB (less than half) gets its own, so a small pull does not pin a big mapping."""

    def pull_of(mib: int) -> list[np.ndarray]:
        return kv_arrays([((mib << 18,), "float32")])

    big = pull_of(8)
    big_address = address(big[0])
    del big
    gc.collect()
    small = pull_of(3)
    assert address(small[0]) != big_address
    smaller = pull_of(5)
    assert address(smaller[0]) == big_address
    assert smaller[0].nbytes == 5 << 20
