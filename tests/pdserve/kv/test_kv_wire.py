"""The stream threads' frame I/O (pdserve.kv.wire) keeps the byte stream's order however the peer splits and times
its writes, lands DATA in place, bounds every read, and can be woken from another thread."""

from __future__ import annotations

import random
import socket
import threading
import time

import numpy as np
import pytest

from pdserve.kv.errors import KVTransferError
from pdserve.kv.protocol import DATA_HEADER, FrameType, encode_header
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
    stream = (
        encode_header(FrameType.MANIFEST, control)
        + control
        + encode_header(FrameType.DATA, sub, payload)
        + sub
        + payload
        + encode_header(FrameType.END, control)
        + control
    )
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
