"""The KV channel over TLS with a self-signed certificate made by the openssl CLI."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv import KVConnectionPool, KVMetrics, KVTransferError, LeaseStore, SecretKey, pull

from .kvtestlib import make_layers, meta_for, running_server


def tls_contexts(certificate: tuple[Path, Path]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The server's context, and a client's that trusts the self-signed certificate."""
    cert, private_key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, private_key)
    return server_tls, ssl.create_default_context(cafile=str(cert))


def test_tls_round_trip_and_untrusted_certificate_refused(
    certificate: tuple[Path, Path], key: SecretKey, metrics: KVMetrics
):
    server_tls, trusting = tls_contexts(certificate)
    store = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=8192, metrics=metrics)
    layers = make_layers(4, (32, 128), "float16")
    stored = store.put("tls-1", layers, meta_for("tls-1"))

    async def scenario() -> None:
        async with running_server(store, key, ssl_context=server_tls, metrics=metrics) as server:
            blob = await pull(
                "127.0.0.1",
                server.port,
                "tls-1",
                stored.checksum,
                key=key,
                streams=3,
                ssl_context=trusting,
                server_hostname="localhost",
                retries=0,
            )
            assert [k.tobytes() + v.tobytes() for k, v in blob.layers] == [k.tobytes() + v.tobytes() for k, v in layers]
            with pytest.raises(KVTransferError) as raised:
                await pull(
                    "127.0.0.1",
                    server.port,
                    "tls-1",
                    stored.checksum,
                    key=key,
                    ssl_context=ssl.create_default_context(),
                    server_hostname="localhost",
                    retries=0,
                )
            assert raised.value.cause == "auth"

    asyncio.run(scenario())


def test_tls_connections_are_reused_and_replaced_after_a_server_restart(
    certificate: tuple[Path, Path], key: SecretKey, metrics: KVMetrics
):
    server_tls, trusting = tls_contexts(certificate)
    store = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=8192, metrics=metrics)
    layers = make_layers(4, (32, 128), "float16")
    stored = store.put("tls-2", layers, meta_for("tls-2"))
    client_metrics = KVMetrics(CollectorRegistry())

    async def scenario() -> None:
        pool = KVConnectionPool(metrics=client_metrics)
        options = {
            "key": key,
            "streams": 2,
            "ssl_context": trusting,
            "server_hostname": "localhost",
            "retries": 0,
            "pool": pool,
            "metrics": client_metrics,
        }
        async with running_server(store, key, ssl_context=server_tls, metrics=metrics) as server:
            port = server.port
            for _ in range(2):
                await pull("127.0.0.1", port, "tls-2", stored.checksum, **options)  # type: ignore[arg-type]
            assert connections(client_metrics, "reused") == 2
        async with running_server(store, key, ssl_context=server_tls, port=port, metrics=metrics):
            blob = await pull("127.0.0.1", port, "tls-2", stored.checksum, **options)  # type: ignore[arg-type]
            assert [k.tobytes() + v.tobytes() for k, v in blob.layers] == [k.tobytes() + v.tobytes() for k, v in layers]
        await pool.close()

    asyncio.run(scenario())
    assert connections(client_metrics, "new") == 4
    assert client_metrics.bytes.labels("receiver")._value.get() == 3 * stored.nbytes


def connections(metrics: KVMetrics, outcome: str) -> float:
    value: float = metrics.connections.labels("receiver", outcome)._value.get()
    return value


def test_the_name_verified_defaults_to_the_host_pulled_from(
    certificate: tuple[Path, Path], key: SecretKey, metrics: KVMetrics
) -> None:
    """Without server_hostname, the certificate is checked against the host given (as decode's connector does)."""
    server_tls, trusting = tls_contexts(certificate)
    store = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=8192, metrics=metrics)
    layers = make_layers(2, (8, 64), "float16")
    stored = store.put("tls-name", layers, meta_for("tls-name"))

    async def scenario() -> None:
        async with running_server(store, key, ssl_context=server_tls, metrics=metrics) as server:
            for host in ("127.0.0.1", "localhost"):  # both in the certificate's subjectAltName
                blob = await pull(
                    host, server.port, "tls-name", stored.checksum, key=key, ssl_context=trusting, retries=0
                )
                assert blob.meta.token_count == stored.meta.token_count

    asyncio.run(scenario())
