"""KV connection reuse over real loopback sockets: a pool's connections carry later pulls and acks, are replaced
when the server went away, and never carry a request after an error or two requests at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv import KVConnectionPool, KVMetrics, KVTransferError, LeaseStore, SecretKey, ack, pull
from pdserve.kv.connect import Connector
from pdserve.kv.pool import KVConnection
from pdserve.kv.protocol import FrameType, encode_header
from pdserve.server.kvlink import DecodeImporter
from pdserve.server.metrics import ServerMetrics
from pdserve.server.schemas import KVTransferParams
from pdserve.server.settings import Role, ServerSettings

from .kvtestlib import make_layers, meta_for, proxy_to, read_frame, running_server

FAST = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, "retries": 1, "backoff_s": 0.05}


def small_store(metrics: KVMetrics) -> LeaseStore:
    return LeaseStore(capacity_bytes=64 << 20, chunk_bytes=4096, metrics=metrics)


def connections(metrics: KVMetrics, role: str, outcome: str) -> float:
    value: float = metrics.connections.labels(role, outcome)._value.get()
    return value


def failures(metrics: KVMetrics) -> float:
    return sum(sample.value for sample in metrics.failures.collect()[0].samples if sample.name.endswith("_total"))


def same_bytes(a: list[tuple[object, object]], b: list[tuple[object, object]]) -> bool:
    return [k.tobytes() + v.tobytes() for k, v in a] == [k.tobytes() + v.tobytes() for k, v in b]


def test_later_pulls_and_acks_reuse_the_pools_connections(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    layers = make_layers(4, (32, 32), "float32")
    stored = store.put("reuse-1", layers, meta_for("reuse-1"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            pool = KVConnectionPool(metrics=metrics)
            for _ in range(2):
                blob = await pull(
                    "127.0.0.1", server.port, "reuse-1", stored.checksum, key=key, streams=4, pool=pool, **FAST
                )
                assert same_bytes(blob.layers, layers)
            assert len(pool) == 4
            assert await ack("127.0.0.1", server.port, "reuse-1", key=key, pool=pool) is True
            await pool.close()

    asyncio.run(scenario())
    # The second pull's 4 streams and the ack ran on the first pull's 4 connections: the server accepted only those.
    assert connections(metrics, "sender", "new") == 4
    assert connections(metrics, "sender", "reused") == 5
    assert connections(metrics, "receiver", "new") == 4
    assert connections(metrics, "receiver", "reused") == 5
    assert store.bytes_held == 0


def test_without_a_pool_every_stream_opens_its_own_connection(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("nopool-1", make_layers(2, (16, 16), "float32"), meta_for("nopool-1"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            for _ in range(2):
                await pull(
                    "127.0.0.1", server.port, "nopool-1", stored.checksum, key=key, streams=3, metrics=metrics, **FAST
                )

    asyncio.run(scenario())
    assert connections(metrics, "sender", "new") == 6
    assert connections(metrics, "sender", "reused") == 0
    assert connections(metrics, "receiver", "new") == 6


def test_server_restart_between_pulls_is_survived_transparently(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    layers = make_layers(3, (64, 16), "float16")
    stored = store.put("restart-1", layers, meta_for("restart-1"))
    client_metrics, second_server = KVMetrics(CollectorRegistry()), KVMetrics(CollectorRegistry())

    async def scenario() -> None:
        pool = KVConnectionPool(metrics=client_metrics)
        async with running_server(store, key, metrics=metrics) as first:
            port = first.port
            await pull(
                "127.0.0.1",
                port,
                "restart-1",
                stored.checksum,
                key=key,
                streams=4,
                pool=pool,
                metrics=client_metrics,
                **FAST,
            )
            assert len(pool) == 4
        async with running_server(store, key, port=port, metrics=second_server):
            blob = await pull(
                "127.0.0.1",
                port,
                "restart-1",
                stored.checksum,
                key=key,
                streams=4,
                pool=pool,
                metrics=client_metrics,
                **FAST,
            )
            assert same_bytes(blob.layers, layers)
        await pool.close()

    asyncio.run(scenario())
    assert failures(client_metrics) == 0
    assert client_metrics.bytes.labels("receiver")._value.get() == 2 * stored.nbytes
    # Every connection to the old server was found closed and replaced; the new server served new connections only.
    assert connections(client_metrics, "receiver", "stale") >= 1
    assert connections(client_metrics, "receiver", "new") == 8
    assert connections(second_server, "sender", "new") == 4
    assert connections(second_server, "sender", "reused") == 0


def test_connection_closed_while_idle_and_noticed_only_when_used_is_replaced(key: SecretKey, metrics: KVMetrics):
    """The race a borrow-time check cannot catch: the connection looks open, the request goes out, the peer is gone."""
    store = small_store(metrics)
    layers = make_layers(4, (16, 64), "int8")
    stored = store.put("sever-1", layers, meta_for("sever-1"))
    client_metrics = KVMetrics(CollectorRegistry())

    async def scenario() -> None:
        pool = KVConnectionPool(metrics=client_metrics)
        async with running_server(store, key, metrics=metrics) as server, proxy_to(server.port) as proxy:
            options = {"key": key, "pool": pool, "metrics": client_metrics, **FAST}
            await pull("127.0.0.1", proxy.port, "sever-1", stored.checksum, streams=3, **options)
            proxy.sever_when_used()
            blob = await pull("127.0.0.1", proxy.port, "sever-1", stored.checksum, streams=3, **options)
            assert same_bytes(blob.layers, layers)
            assert store.bytes_held == stored.nbytes  # the repeated PULL changed nothing on the server
            proxy.sever_when_used()
            assert await ack("127.0.0.1", proxy.port, "sever-1", key=key, pool=pool) is True
        await pool.close()

    asyncio.run(scenario())
    assert failures(client_metrics) == 0
    assert connections(client_metrics, "receiver", "reused") == 4  # 3 streams and the ack borrowed pooled ones
    assert connections(client_metrics, "receiver", "stale") == 4  # ... each found severed and replaced
    assert connections(client_metrics, "receiver", "new") == 3 + 3 + 1
    assert connections(metrics, "sender", "new") == 7  # no severed request ever reached the server
    assert store.bytes_held == 0


def test_connection_that_saw_an_error_is_never_reused(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("err-1", make_layers(8, (64, 64), "float32"), meta_for("err-1", fingerprint="model-a"))
    client_metrics = KVMetrics(CollectorRegistry())

    async def scenario() -> None:
        pool = KVConnectionPool(metrics=client_metrics)
        async with running_server(store, key, metrics=metrics) as server:
            options = {"key": key, "pool": pool, "metrics": client_metrics, **FAST}
            await pull("127.0.0.1", server.port, "err-1", stored.checksum, streams=2, **options)
            assert len(pool) == 2
            # The server answers ERROR and closes: the borrowed connections must not come back.
            with pytest.raises(KVTransferError, match="not_found"):
                await pull("127.0.0.1", server.port, "nobody", stored.checksum, streams=2, **options)
            assert len(pool) == 0
            await pull("127.0.0.1", server.port, "err-1", stored.checksum, streams=2, **options)
            # Here the server is still streaming data into the connection when decode refuses the fingerprint:
            # reusing it would read that data as the next reply.
            with pytest.raises(KVTransferError, match="fingerprint"):
                await pull(
                    "127.0.0.1",
                    server.port,
                    "err-1",
                    stored.checksum,
                    streams=2,
                    expected_fingerprint="model-b",
                    **options,
                )
            assert len(pool) == 0
            await pull("127.0.0.1", server.port, "err-1", stored.checksum, streams=2, **options)
        await pool.close()

    asyncio.run(scenario())
    # Each pull after an error opened fresh connections; only the failing pulls borrowed pooled ones.
    assert connections(client_metrics, "receiver", "new") == 6
    assert connections(client_metrics, "receiver", "reused") == 4
    assert connections(client_metrics, "receiver", "stale") == 0


def test_flipped_byte_is_detected_on_a_reused_connection(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("flip-1", make_layers(4, (64, 64), "float16"), meta_for("flip-1"))
    client_metrics = KVMetrics(CollectorRegistry())

    async def scenario() -> None:
        pool = KVConnectionPool(metrics=client_metrics)
        async with running_server(store, key) as server, proxy_to(server.port) as proxy:
            options = {"key": key, "pool": pool, "metrics": client_metrics, "streams": 1, **FAST}
            await pull("127.0.0.1", proxy.port, "flip-1", stored.checksum, **options)
            proxy.corrupt_at = proxy.forwarded + 20_000
            with pytest.raises(KVTransferError) as raised:
                await pull("127.0.0.1", proxy.port, "flip-1", stored.checksum, **options)
            assert raised.value.cause == "checksum"
            assert len(pool) == 0  # the connection was mid-stream: closed, not pooled
            # The pull after it opens a new connection and succeeds, so the error came from the flipped byte.
            await pull("127.0.0.1", proxy.port, "flip-1", stored.checksum, **options)
        await pool.close()

    asyncio.run(scenario())
    assert connections(client_metrics, "receiver", "reused") == 1  # the corrupted pull ran on a reused connection
    assert connections(client_metrics, "receiver", "new") == 2
    assert client_metrics.failures.labels("receiver", "checksum")._value.get() == 1


class WatchedPool(KVConnectionPool):
    """Records every connection lent out, to prove none is lent twice at once."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.held: set[KVConnection] = set()
        self.double_lends = 0
        self.most_held = 0

    async def acquire(self, connector: Connector, host: str, port: int) -> KVConnection:
        connection = await super().acquire(connector, host, port)
        self.double_lends += connection in self.held
        self.held.add(connection)
        self.most_held = max(self.most_held, len(self.held))
        return connection

    def release(self, connection: KVConnection, *, reusable: bool) -> None:
        self.held.discard(connection)
        super().release(connection, reusable=reusable)


def test_concurrent_pulls_never_share_a_connection(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    blobs = {f"conc-{n}": make_layers(3, (48, 40), "float32", seed=n) for n in range(4)}
    checksums = {rid: store.put(rid, layers, meta_for(rid)).checksum for rid, layers in blobs.items()}
    client_metrics = KVMetrics(CollectorRegistry())

    async def scenario() -> None:
        pool = WatchedPool(metrics=client_metrics)
        async with running_server(store, key, metrics=metrics) as server:

            async def one(rid: str) -> None:
                blob = await pull(
                    "127.0.0.1",
                    server.port,
                    rid,
                    checksums[rid],
                    key=key,
                    streams=3,
                    pool=pool,
                    metrics=client_metrics,
                    **FAST,
                )
                assert same_bytes(blob.layers, blobs[rid])

            await one("conc-0")  # leaves 3 idle connections
            await asyncio.gather(*(one(rid) for rid in blobs))
            opened_by_first_round = connections(client_metrics, "receiver", "new")
            for _ in range(2):
                await asyncio.gather(*(one(rid) for rid in blobs))
            # Later rounds ran entirely on connections the first concurrent round left behind.
            assert connections(client_metrics, "receiver", "new") == opened_by_first_round
        await pool.close()
        assert pool.double_lends == 0
        assert pool.most_held > 3  # more than one pull's streams held connections at the same time

    asyncio.run(scenario())
    assert failures(client_metrics) == 0
    assert connections(client_metrics, "receiver", "new") <= 12


def test_pool_close_closes_idle_and_borrowed_connections(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("close-1", make_layers(2, (8, 8), "float32"), meta_for("close-1"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            pool = KVConnectionPool(metrics=metrics)
            await pull("127.0.0.1", server.port, "close-1", stored.checksum, key=key, streams=3, pool=pool, **FAST)
            borrowed = await pool.acquire(Connector(key), "127.0.0.1", server.port)
            assert borrowed.reused and len(pool) == 2
            handlers = list(server._connections)
            assert len(handlers) == 3
            await pool.close()
            assert len(pool) == 0 and borrowed.closed
            # Each server-side handler (a thread per connection) ends because its client closed the connection.
            for handler in handlers:
                await asyncio.to_thread(handler.join, 5)
            assert not any(handler.is_alive() for handler in handlers)
            with pytest.raises(KVTransferError) as raised:
                await pull("127.0.0.1", server.port, "close-1", stored.checksum, key=key, pool=pool, **FAST)
            assert raised.value.cause == "connection"

    asyncio.run(scenario())


def test_idle_connections_expire_and_each_server_keeps_a_bounded_number(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("idle-1", make_layers(2, (8, 8), "float32"), meta_for("idle-1"))
    now = [1000.0]
    client_metrics = KVMetrics(CollectorRegistry())

    async def scenario() -> None:
        pool = KVConnectionPool(max_idle_per_peer=2, idle_timeout_s=10, metrics=client_metrics, clock=lambda: now[0])
        async with running_server(store, key, metrics=metrics) as server:
            options = {"key": key, "pool": pool, "streams": 4, **FAST}
            await pull("127.0.0.1", server.port, "idle-1", stored.checksum, **options)
            assert len(pool) == 2  # two of the four connections were closed on return
            now[0] += 9
            await pull("127.0.0.1", server.port, "idle-1", stored.checksum, **options)
            assert connections(client_metrics, "receiver", "reused") == 2
            expiring = [connection for idle in pool._idle.values() for connection in idle]
            now[0] += 11
            await pull("127.0.0.1", server.port, "idle-1", stored.checksum, **options)
            assert connections(client_metrics, "receiver", "reused") == 2  # the idle ones had expired ...
            assert len(expiring) == 2 and all(connection.closed for connection in expiring)  # ... closed
        await pool.close()

    asyncio.run(scenario())
    assert connections(client_metrics, "receiver", "stale") == 0  # expired connections were never lent out again
    assert connections(client_metrics, "receiver", "new") == 4 + 2 + 4
    assert connections(metrics, "sender", "new") == 4 + 2 + 4


def test_pool_never_lends_a_connection_to_other_credentials(key: SecretKey, kv_key_file: Path, metrics: KVMetrics):
    store = small_store(metrics)
    stored = store.put("cred-1", make_layers(2, (8, 8), "float32"), meta_for("cred-1"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            pool = KVConnectionPool(metrics=metrics)
            await pull("127.0.0.1", server.port, "cred-1", stored.checksum, key=key, streams=2, pool=pool, **FAST)
            same_key_read_again = SecretKey.from_file(kv_key_file)
            await pull(
                "127.0.0.1",
                server.port,
                "cred-1",
                stored.checksum,
                key=same_key_read_again,
                streams=2,
                pool=pool,
                **FAST,
            )
            await pool.close()

    asyncio.run(scenario())
    assert connections(metrics, "receiver", "new") == 4
    assert connections(metrics, "receiver", "reused") == 0


def test_corrupted_request_frame_on_an_open_connection_is_answered_with_an_error(key: SecretKey, metrics: KVMetrics):
    store = small_store(metrics)
    store.put("bad-1", make_layers(1, (8,), "float32"), meta_for("bad-1"))

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            channel = await Connector(key).connect("127.0.0.1", server.port)  # authenticated, then raw frames
            reader, writer = await asyncio.open_connection(sock=channel.sock)
            body = b'{"request_id": "bad-1", "stream": 0, "streams": 1}'
            header = bytearray(encode_header(FrameType.PULL, body))
            header[-1] ^= 0xFF  # the frame's crc32c no longer matches
            writer.write(bytes(header) + body)
            reply = await read_frame(reader, 5)
            writer.close()
            assert reply.type is FrameType.ERROR and reply.json()["cause"] == "checksum"

    asyncio.run(scenario())
    assert metrics.failures.labels("sender", "checksum")._value.get() == 1


def test_decode_importer_pulls_and_acks_through_one_pool_and_closes_it(
    tmp_path: Path, kv_key_file: Path, key: SecretKey, metrics: KVMetrics
):
    store = small_store(metrics)
    sent = {rid: make_layers(3, (8, 16), "float32", seed=n) for n, rid in enumerate(("dec-1", "dec-2"))}
    checksums = {rid: store.put(rid, layers, meta_for(rid, token_count=7)).checksum for rid, layers in sent.items()}
    settings = ServerSettings(
        role=Role.DECODE, model=tmp_path, kv_key_file=kv_key_file, kv_streams=2, api_token_file=tmp_path / "api.token"
    )
    engine = SimpleNamespace(fingerprint="fp-test-1", cache_from_layers=lambda layers, tokens: (layers, tokens))
    server_metrics = ServerMetrics(CollectorRegistry())
    importer = DecodeImporter(settings, engine, key, server_metrics)  # type: ignore[arg-type]

    async def scenario() -> None:
        async with running_server(store, key, metrics=metrics) as server:
            for rid, layers in sent.items():
                params = KVTransferParams(
                    do_remote_prefill=True,
                    remote_engine_id="prefill-1",
                    remote_request_id=rid,
                    remote_host="127.0.0.1",
                    remote_port=server.port,
                    remote_block_ids=[],
                    kv_checksum=checksums[rid],
                    kv_fingerprint="fp-test-1",
                    num_tokens=8,
                )
                got, tokens = await importer.load(params, prompt_tokens=8)
                assert tokens == 7 and same_bytes(got, layers)
            await importer.close()  # lets the acks under way finish, then closes the pool
            assert len(importer.pool) == 0
            with pytest.raises(KVTransferError):
                await importer.pool.acquire(Connector(key), "127.0.0.1", server.port)

    asyncio.run(scenario())
    assert store.bytes_held == 0  # both acks arrived
    kv = server_metrics.kv
    # 2 pulls x 2 streams and 2 acks; without the pool each would have opened a connection. (How many are new depends
    # on whether the first ack, sent in the background, still holds its connection when the second pull starts.)
    assert connections(kv, "receiver", "new") + connections(kv, "receiver", "reused") == 6
    assert connections(kv, "receiver", "new") <= 3
    assert connections(metrics, "sender", "new") == connections(kv, "receiver", "new")
