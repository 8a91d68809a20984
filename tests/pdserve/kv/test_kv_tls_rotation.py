"""The KV channel's certificates rotate without a restart and without a failed pull (#17): prefill's listener and
decode's client contexts are pdserve.common.tls RotatingContexts, rebuilt from their files and swapped in between
handshakes. Mutual TLS: with a CA set on the listener, a puller without a certificate from it is refused."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509

from pdserve.common.kv_tls import kv_client_context, kv_server_context
from pdserve.kv import KVMetrics, KVTransferError, LeaseStore, SecretKey, pull
from tests.support.tlsfiles import issue, new_ca, serial_of

from .kvtestlib import make_layers, meta_for, running_server

CHECK_SECONDS = 0.05
PULLS_ACROSS_ROTATION = 60


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return new_ca(tmp_path_factory.mktemp("kv-ca"), "pdstack test KV CA")


def replace_file(source: Path, target: Path) -> None:
    """As a deploy writes a file: a new inode renamed over the old one."""
    staged = target.with_suffix(".new")
    staged.write_bytes(source.read_bytes())
    os.replace(staged, target)


def served_serial(port: int, ca: Path, client: tuple[Path, Path]) -> int:
    """The serial of the certificate the KV listener presents to a fresh handshake."""
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(*client)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def test_a_rotated_kv_certificate_is_served_without_a_failed_pull(
    ca: tuple[Path, Path], tmp_path: Path, key: SecretKey, metrics: KVMetrics
) -> None:
    live_cert, live_key = issue(ca, tmp_path, "prefill")
    next_cert, next_key = issue(ca, tmp_path, "prefill-next")
    first_serial = serial_of(live_cert)
    decode = issue(ca, tmp_path, "decode")
    server_tls = kv_server_context(live_cert, live_key, ca[0], CHECK_SECONDS)
    client_tls = kv_client_context(ca[0], *decode, CHECK_SECONDS)
    store = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=8192, metrics=metrics)
    layers = make_layers(4, (32, 128), "float16")
    stored = store.put("rot-1", layers, meta_for("rot-1"))
    failures: list[BaseException] = []

    async def scenario() -> None:
        async with running_server(store, key, ssl_context=server_tls, metrics=metrics) as server:
            before = await asyncio.to_thread(served_serial, server.port, ca[0], decode)
            rotated = threading.Event()

            async def pulls() -> None:
                for index in range(PULLS_ACROSS_ROTATION):
                    if index == PULLS_ACROSS_ROTATION // 3:
                        # a half-written pair first (the new certificate, the old key): still the old one served
                        replace_file(next_cert, live_cert)
                        await asyncio.sleep(3 * CHECK_SECONDS)
                        replace_file(next_key, live_key)
                        rotated.set()
                    try:
                        await pull(
                            "127.0.0.1",
                            server.port,
                            "rot-1",
                            stored.checksum,
                            key=key,
                            streams=2,
                            ssl_context=client_tls,
                            server_hostname="localhost",
                            retries=0,
                        )
                    except KVTransferError as error:
                        failures.append(error)
                    await asyncio.sleep(CHECK_SECONDS / 5)

            await pulls()
            assert rotated.is_set()
            after = await asyncio.to_thread(served_serial, server.port, ca[0], decode)
            assert before == first_serial != after == serial_of(next_cert)

    asyncio.run(scenario())
    assert failures == []


def test_with_a_ca_on_the_listener_a_puller_without_a_certificate_is_refused(
    ca: tuple[Path, Path], tmp_path: Path, key: SecretKey, metrics: KVMetrics
) -> None:
    server_tls = kv_server_context(*issue(ca, tmp_path, "prefill"), ca[0], CHECK_SECONDS)
    anonymous = kv_client_context(ca[0], None, None, CHECK_SECONDS)
    store = LeaseStore(capacity_bytes=16 << 20, chunk_bytes=8192, metrics=metrics)
    stored = store.put("mtls-1", make_layers(2, (8, 16), "float16"), meta_for("mtls-1"))

    async def scenario() -> None:
        async with running_server(store, key, ssl_context=server_tls, metrics=metrics) as server:
            with pytest.raises(KVTransferError) as refused:
                await pull(
                    "127.0.0.1",
                    server.port,
                    "mtls-1",
                    stored.checksum,
                    key=key,
                    ssl_context=anonymous,
                    server_hostname="localhost",
                    retries=0,
                )
            # TLS 1.3 sends the listener's refusal after the client's handshake ends: the first frame meets it
            assert refused.value.cause in {"auth", "connect", "connection"}, refused.value

    asyncio.run(scenario())
    assert metrics.bytes.labels("sender")._value.get() == 0


def test_a_plaintext_peer_gets_no_kv_frame(
    ca: tuple[Path, Path], tmp_path: Path, key: SecretKey, metrics: KVMetrics
) -> None:
    server_tls = kv_server_context(*issue(ca, tmp_path, "prefill"), None, CHECK_SECONDS)
    store = LeaseStore(capacity_bytes=1 << 20, chunk_bytes=8192, metrics=metrics)

    async def scenario() -> bytes:
        async with running_server(store, key, ssl_context=server_tls, metrics=metrics) as server:
            return await asyncio.to_thread(plaintext_exchange, server.port)

    # the listener answers a plaintext hello with a TLS alert or by closing: never a KV frame
    answer = asyncio.run(scenario())
    assert answer == b"" or answer[:1] == b"\x15", answer[:16]


def plaintext_exchange(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            return raw.recv(64)
        except (ConnectionResetError, TimeoutError):
            return b""
