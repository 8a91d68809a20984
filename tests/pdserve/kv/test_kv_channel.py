"""The KV channel over real loopback sockets: bit-exact transfer, integrity, auth, leases, faults and metrics."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from pdserve.kv import KVMetrics, KVTransferError, LeaseStore, SecretKey, ack, pull
from pdserve.kv.protocol import FrameType, encode_header

from .kvtestlib import make_layers, meta_for, proxy_to, running_server, server_process

FAST = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "retries": 1, "backoff_s": 0.05}


def small_store(metrics: KVMetrics, **options: float) -> LeaseStore:
    return LeaseStore(capacity_bytes=64 << 20, chunk_bytes=4096, metrics=metrics, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "shape", "streams"),
    [
        ("float16", (4, 33, 16), 1),
        ("float32", (2, 257, 8), 3),
        ("int8", (5, 1001), 8),
        ("uint16", (3, 64, 64), 4),  # how bfloat16 KV travels: as raw 16-bit words
    ],
)
def test_round_trip_is_bit_exact(key: SecretKey, metrics: KVMetrics, dtype: str, shape: tuple[int, ...], streams: int):
    layers = make_layers(6, shape, dtype, seed=streams)
    store = small_store(metrics)
    stored = store.put("req-1", layers, meta_for("req-1", token_count=33))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            blob = await pull(
                "127.0.0.1", server.port, "req-1", stored.checksum, key=key, streams=streams, metrics=metrics, **FAST
            )
            assert blob.meta == meta_for("req-1", token_count=33)
            assert len(blob.layers) == len(layers)
            for (k, v), (k2, v2) in zip(layers, blob.layers, strict=True):
                for sent, got in ((k, k2), (v, v2)):
                    assert got.dtype == sent.dtype and got.shape == sent.shape
                    assert got.tobytes() == sent.tobytes()

    asyncio.run(scenario())
    received = metrics.bytes.labels("receiver")._value.get()
    assert received == stored.nbytes


def test_pull_is_idempotent_until_ack_frees_the_lease(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("req-2", make_layers(3, (16, 16), "float32"), meta_for("req-2"))
    assert store.bytes_held == stored.nbytes

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            first = await pull("127.0.0.1", server.port, "req-2", stored.checksum, key=key, streams=2, **FAST)
            second = await pull("127.0.0.1", server.port, "req-2", stored.checksum, key=key, streams=3, **FAST)
            for (k1, v1), (k2, v2) in zip(first.layers, second.layers, strict=True):
                assert k1.tobytes() == k2.tobytes() and v1.tobytes() == v2.tobytes()
            assert await ack("127.0.0.1", server.port, "req-2", key=key) is True
            assert store.bytes_held == 0
            assert await ack("127.0.0.1", server.port, "req-2", key=key) is False
            with pytest.raises(KVTransferError) as raised:
                await pull("127.0.0.1", server.port, "req-2", stored.checksum, key=key, **FAST)
            assert raised.value.cause == "not_found"

    asyncio.run(scenario())
    assert metrics.lease_bytes._value.get() == 0


def test_flipped_byte_in_transit_is_detected(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("req-3", make_layers(4, (64, 64), "float16"), meta_for("req-3"))

    async def scenario() -> None:
        async with running_server(store, key) as server, proxy_to(server.port, corrupt_at=20_000) as proxy:
            with pytest.raises(KVTransferError) as raised:
                await pull(
                    "127.0.0.1", proxy.port, "req-3", stored.checksum, key=key, streams=1, metrics=metrics, **FAST
                )
            assert raised.value.cause == "checksum"
            # The same pull without the fault succeeds, so the error came from the flipped byte.
            await pull("127.0.0.1", server.port, "req-3", stored.checksum, key=key, streams=1, **FAST)

    asyncio.run(scenario())
    assert metrics.failures.labels("receiver", "checksum")._value.get() == 1


def test_wrong_key_is_refused_and_counted(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("req-4", make_layers(1, (8,), "float32"), meta_for("req-4"))
    wrong = SecretKey(os.urandom(32))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            with pytest.raises(KVTransferError) as raised:
                await pull("127.0.0.1", server.port, "req-4", stored.checksum, key=wrong, **FAST)
            assert raised.value.cause == "auth"
            while metrics.auth_refused._value.get() < 1:  # the server counts the refusal on its own schedule
                await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert store.bytes_held == stored.nbytes


def test_client_skipping_auth_gets_no_kv(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    store.put("req-5", make_layers(1, (8,), "float32"), meta_for("req-5"))

    async def scenario() -> bytes:
        async with running_server(store, key, metrics=metrics) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = b'{"request_id": "req-5", "stream": 0, "streams": 1}'
            writer.write(encode_header(FrameType.PULL, body) + body)
            reply = await asyncio.wait_for(reader.read(), timeout=5)
            writer.close()
            return reply

    reply = asyncio.run(scenario())
    assert reply[5] == FrameType.ERROR and b'"cause": "auth"' in reply
    assert b"layers" not in reply
    assert metrics.auth_refused._value.get() == 1


def test_expired_lease_is_reported_as_expired(key: SecretKey, metrics: KVMetrics):
    now = [100.0]
    store = small_store(metrics, default_lease_s=5.0, clock=lambda: now[0])  # type: ignore[arg-type]
    stored = store.put("req-6", make_layers(2, (8, 8), "float32"), meta_for("req-6"))
    now[0] += 6.0

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            with pytest.raises(KVTransferError) as raised:
                await pull("127.0.0.1", server.port, "req-6", stored.checksum, key=key, **FAST)
            assert raised.value.cause == "expired"

    asyncio.run(scenario())
    assert store.bytes_held == 0


def test_reaper_frees_expired_leases_in_the_background(metrics: KVMetrics):
    store = small_store(metrics)
    store.put("req-7", make_layers(2, (8, 8), "float32"), meta_for("req-7"), lease_s=0.05)
    store.put("req-8", make_layers(2, (8, 8), "float32"), meta_for("req-8"), lease_s=300)

    async def scenario() -> None:
        store.start_reaper(interval_s=0.02)
        while len(store) > 1:  # bounded by the test timeout; the reaper must empty the expired entry
            await asyncio.sleep(0.02)
        await store.stop_reaper()

    asyncio.run(scenario())
    assert store.bytes_held == 2 * 2 * 8 * 8 * 4
    assert metrics.lease_released.labels("expired")._value.get() == 1


def test_full_store_refuses_new_kv_with_capacity_error(metrics: KVMetrics):
    store = LeaseStore(capacity_bytes=1000, metrics=metrics)
    store.put("a", make_layers(1, (100,), "float32"), meta_for("a"))
    with pytest.raises(KVTransferError) as raised:
        store.put("b", make_layers(1, (100,), "float32"), meta_for("b"))
    assert raised.value.cause == "capacity"
    assert "800 of 1000 bytes" in str(raised.value)
    assert len(store) == 1


def test_fingerprint_and_announced_checksum_are_enforced(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("req-9", make_layers(2, (8, 8), "float32"), meta_for("req-9", fingerprint="model-a"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            with pytest.raises(KVTransferError) as mismatch:
                await pull(
                    "127.0.0.1", server.port, "req-9", stored.checksum, key=key, expected_fingerprint="model-b", **FAST
                )
            assert mismatch.value.cause == "fingerprint"
            with pytest.raises(KVTransferError) as wrong_sum:
                await pull("127.0.0.1", server.port, "req-9", "sha256:" + "0" * 64, key=key, **FAST)
            assert wrong_sum.value.cause == "checksum"

    asyncio.run(scenario())


def test_a_manifest_larger_than_the_request_can_hold_is_refused(key: SecretKey, metrics: KVMetrics):
    """max_bytes (decode: its own request's KV) bounds what an authenticated server's manifest makes a pull allocate:
    announced before the bytes, refused before the destination arrays exist."""
    store = small_store(metrics)
    stored = store.put("req-10", make_layers(2, (8, 8), "float32"), meta_for("req-10"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            with pytest.raises(KVTransferError) as too_big:
                await pull("127.0.0.1", server.port, "req-10", None, key=key, max_bytes=stored.nbytes - 1, **FAST)
            assert too_big.value.cause == "protocol"
            assert f"announces {stored.nbytes} bytes" in too_big.value.message
            blob = await pull("127.0.0.1", server.port, "req-10", None, key=key, max_bytes=stored.nbytes, **FAST)
            assert blob.meta.request_id == "req-10"

    asyncio.run(scenario())


def test_server_killed_mid_transfer_fails_fast_with_connection_error(kv_key_file: Path, key: SecretKey):
    with server_process(kv_key_file, "req-kill", 32) as (process, port, checksum):

        def kill_after_first_mebibyte(forwarded: int) -> None:
            if forwarded > 1 << 20 and process.poll() is None:
                process.kill()

        async def scenario() -> None:
            throttled = {"bytes_per_second": 8e6, "on_forward": kill_after_first_mebibyte}
            async with proxy_to(port, **throttled) as proxy:
                with pytest.raises(KVTransferError) as raised:
                    async with asyncio.timeout(30):  # guards against a hang only; the read timeout is 5 s
                        await pull("127.0.0.1", proxy.port, "req-kill", checksum, key=key, streams=2, **FAST)
                assert raised.value.cause in ("connection", "timeout")
                assert proxy.forwarded < 32 << 20

        asyncio.run(scenario())
        assert process.poll() is not None


@pytest.mark.slow  # waits out the read timeout
def test_stalled_server_hits_the_read_timeout(key: SecretKey):
    async def scenario() -> None:
        async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()

        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(KVTransferError) as raised:
            # Its TCP stack answers (the kernel acknowledges): the pull outwaits it up to stall_timeout_s, by
            # default four read timeouts.
            await pull("127.0.0.1", port, "x", "sha256:00", key=key, read_timeout_s=0.3, retries=0)
        assert raised.value.cause == "timeout" and "within 1.2 s (stall_timeout_s)" in raised.value.message
        server.close()

    asyncio.run(scenario())


def test_nothing_listening_gives_connection_error_after_bounded_retries(key: SecretKey):
    with socket.socket() as probe:  # a port that was free a moment ago and has no listener
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> None:
        with pytest.raises(KVTransferError) as raised:
            await pull("127.0.0.1", port, "x", "sha256:00", key=key, retries=2, backoff_s=0.01)
        assert raised.value.cause == "connection"

    asyncio.run(scenario())


def test_key_file_errors_name_the_file_and_never_show_the_key(tmp_path: Path):
    short = tmp_path / "short.key"
    short.write_text("tooshort")
    with pytest.raises(ValueError, match=r"short\.key: needs at least 16 bytes"):
        SecretKey.from_file(short)
    with pytest.raises(ValueError, match=r"missing\.key: cannot read it"):
        SecretKey.from_file(tmp_path / "missing.key")
    secret = "s3cr3t-" * 8
    good = tmp_path / "good.key"
    good.write_text(secret)
    assert secret not in repr(SecretKey.from_file(good))


def test_unknown_congestion_control_is_refused_by_name(key: SecretKey, metrics: KVMetrics):
    async def scenario() -> None:
        with pytest.raises(ValueError, match="tcp_congestion: the kernel refuses 'no-such-cc'"):
            async with running_server(small_store(metrics), key, tcp_congestion="no-such-cc"):
                pass

    asyncio.run(scenario())
