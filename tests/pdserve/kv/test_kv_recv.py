"""The stream threads' frame I/O (pdserve.kv.wire) keeps the byte stream's order however the peer splits and times
its writes, lands DATA in place, bounds every read, and can be woken from another thread."""

from __future__ import annotations

import gc
import random
import socket
import threading
import time

import numpy as np
import pytest

from pdserve.kv.errors import KVTransferError
from pdserve.kv.protocol import DATA_HEADER, FrameType, encode_header
from pdserve.kv.recv import destination_arrays
from pdserve.kv.wire import FrameSocket


def _dribble(sock: socket.socket, data: bytes, seed: int) -> None:
    """Write `data` in random pieces (1 byte to 1 MiB), sometimes pausing, as a slow or bursty peer would."""
    rng, offset = random.Random(seed), 0
    while offset < len(data):
        size = rng.choice([1, 13, 4096, 65536, 300_000, 1 << 20])
        sock.sendall(data[offset : offset + size])
        offset += size
        if rng.random() < 0.2:
            time.sleep(0.001)


def test_frames_land_in_order_and_in_place_when_bytes_arrive_in_any_split() -> None:
    payload = random.Random(7).randbytes(3 << 20)
    sub = DATA_HEADER.pack(2, 1, 4096)
    control = b'{"hello": 1}'
    stream = (encode_header(FrameType.MANIFEST, control) + control + encode_header(FrameType.DATA, sub, payload)
              + sub + payload + encode_header(FrameType.END, control) + control)  # fmt: skip
    left, right = socket.socketpair()
    writer = threading.Thread(target=_dribble, args=(right, stream, 1))
    writer.start()
    channel = FrameSocket(left)
    try:
        assert channel.read_frame(10).payload == control
        header, deadline = channel.read_header(10, 4 << 20)
        assert header.type is FrameType.DATA
        got_sub = channel.recv_bytes(DATA_HEADER.size, deadline, 10)
        destination = np.zeros(len(payload), np.uint8)
        channel.recv_into(memoryview(destination), deadline, 10)
        header.check_crc(got_sub, memoryview(destination))
        assert got_sub == sub and destination.tobytes() == payload
        assert channel.read_frame(10).type is FrameType.END
    finally:
        writer.join()
        channel.close()
        right.close()


def test_a_frame_that_stops_half_way_times_out_and_a_blocked_read_can_be_aborted() -> None:
    left, right = socket.socketpair()
    channel = FrameSocket(left)
    try:
        right.sendall(encode_header(FrameType.END, b"12345678")[:10])
        with pytest.raises(KVTransferError) as stalled:
            channel.read_frame(0.2)
        assert stalled.value.cause == "timeout"
        errors: list[KVTransferError] = []

        def blocked_read() -> None:
            try:
                channel.read_frame(60)
            except KVTransferError as error:
                errors.append(error)

        reader = threading.Thread(target=blocked_read)
        reader.start()
        time.sleep(0.1)
        channel.abort()
        reader.join(10)
        assert not reader.is_alive() and errors and errors[0].cause == "connection"
    finally:
        channel.close()
        right.close()


def test_big_destinations_are_separate_writable_arrays_of_the_asked_layout() -> None:
    specs = [((3, 1 << 18), "float16"), ((5, 7), "int8"), ((1 << 20,), "float32")]
    arrays = destination_arrays(specs)
    for array, (shape, dtype) in zip(arrays, specs, strict=True):
        assert array.shape == shape and array.dtype == dtype and array.flags.writeable
        array[...] = 1
    assert all((array == 1).all() for array in arrays)


@pytest.mark.slow  # maps and pulls a large block (about 1 s)
def test_a_destination_mapping_is_reused_only_once_no_view_of_its_arrays_is_left() -> None:
    specs = [((1 << 20,), "float32"), ((1 << 20,), "float32")]  # 8 MiB: one shared mapping

    def address(array: np.ndarray) -> int:
        return int(array.__array_interface__["data"][0])

    first = destination_arrays(specs)
    first_address = address(first[0])
    first[1][:] = 3.0
    kept = first[1][5:9]  # a caller still holds a view of the first pull's KV
    del first
    gc.collect()
    second = destination_arrays(specs)
    assert address(second[0]) != first_address
    second[1][:] = 4.0
    assert (kept == 3.0).all()  # untouched by the second pull
    del kept
    gc.collect()
    third = destination_arrays(specs)
    assert address(third[0]) == first_address  # free again: reused, no fresh pages to fault in
    assert address(second[0]) != address(third[0])


def test_a_smaller_pull_reuses_an_idle_bigger_mapping_up_to_twice_its_size() -> None:
    """Prompt lengths vary: a pull of 5 MiB after one of 8 MiB lands in the 8 MiB mapping, already faulted in; one of
    3 MiB (less than half) gets its own, so a small pull does not pin a big mapping."""

    def address(array: np.ndarray) -> int:
        return int(array.__array_interface__["data"][0])

    def pull_of(mib: int) -> list[np.ndarray]:
        return destination_arrays([((mib << 18,), "float32")])

    big = pull_of(8)
    big_address = address(big[0])
    del big
    gc.collect()
    small = pull_of(3)
    assert address(small[0]) != big_address
    smaller = pull_of(5)
    assert address(smaller[0]) == big_address
    assert smaller[0].nbytes == 5 << 20
