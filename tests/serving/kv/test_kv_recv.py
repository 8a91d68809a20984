"""The decode side's receive path keeps the byte stream's order however the transport splits and times its reads."""

from __future__ import annotations

import asyncio
import random

from pdserve.kv.recv import KVStreamReader, destination_arrays


def _feed(reader: KVStreamReader, data: bytes) -> None:
    """What a transport does on one readable event: get_buffer, recv_into it, buffer_updated."""
    buffer = reader.get_buffer(-1)
    assert len(buffer) > 0
    count = min(len(buffer), len(data))
    buffer[:count] = data[:count]
    reader.buffer_updated(count)
    if count < len(data):
        _feed(reader, data[count:])


def test_reads_land_in_order_when_bytes_arrive_in_any_split_and_before_the_reader_resumes() -> None:
    stream = random.Random(7).randbytes(3 << 20)

    async def scenario() -> None:
        reader = KVStreamReader()
        rng = random.Random(1)
        head = bytearray(1 << 20)
        tail = bytearray(1 << 20)

        async def consume() -> bytes:
            first = await reader.readexactly(100)
            await reader.read_into(memoryview(head))
            await reader.read_into(memoryview(tail))
            return first + bytes(head) + bytes(tail) + await reader.readexactly(len(stream) - 100 - (2 << 20))

        task = asyncio.create_task(consume())
        offset = 0
        while offset < len(stream):
            size = rng.choice([1, 13, 4096, 65536, 300_000, 1 << 20])
            _feed(reader, stream[offset : offset + size])  # often several feeds before the consumer runs again
            offset += size
            if rng.random() < 0.5:
                await asyncio.sleep(0)
        assert await task == stream

    asyncio.run(scenario())


def test_big_destinations_are_separate_writable_arrays_of_the_asked_layout() -> None:
    specs = [((3, 1 << 18), "float16"), ((5, 7), "int8"), ((1 << 20,), "float32")]
    arrays = destination_arrays(specs)
    for array, (shape, dtype) in zip(arrays, specs, strict=True):
        assert array.shape == shape and array.dtype == dtype and array.flags.writeable
        array[...] = 1
    assert all((array == 1).all() for array in arrays)
