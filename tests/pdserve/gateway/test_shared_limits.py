"""Rate limits across gateway replicas (issue 13 finding 8, contract §6), with a real redis-server on loopback.

No model servers: the limiter decides before routing, so an admitted request is a 503 (no decode instance) and a
refused one a 429; the test counts those. Tenant `scarce` may send 3 requests, then one per 100 s. The TLS store
(issue 17) serves only TLS and requires a client certificate from the test CA, as roles/redis configures it under
the stack's mutual TLS.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from tests.support.cluster import KEYS, Cluster, metric
from tests.support.ports import free_port

from ..test_pdserve_tls import PKI, Files

AUTH = {"Authorization": f"Bearer {KEYS['scarce']}"}
BODY = {"model": "dense", "prompt": "Hi", "max_tokens": 1}


@dataclass
class RedisServer:
    port: int
    password_file: Path
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    tls: tuple[PKI, Files, Files] | None = None
    """TLS only, requiring client certificates: the CA, the server's pair and a client pair the test connects with"""

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def _tls_config(self) -> str:
        if self.tls is None:
            return f"port {self.port}\n"
        pki, server, _ = self.tls
        return (
            f"port 0\ntls-port {self.port}\ntls-cert-file {server.cert}\ntls-key-file {server.key}\n"
            f"tls-ca-cert-file {pki.ca_file}\ntls-auth-clients yes\n"
        )

    def client(self, password: str) -> redis.Redis:
        if self.tls is None:
            return redis.Redis(port=self.port, password=password, socket_timeout=1)
        pki, _, pair = self.tls
        files = {"ssl_ca_certs": str(pki.ca_file), "ssl_certfile": str(pair.cert), "ssl_keyfile": str(pair.key)}
        return redis.Redis(port=self.port, password=password, socket_timeout=1, ssl=True, **files)

    def start(self) -> None:
        server = shutil.which("redis-server")
        assert server, "redis-server missing: apt-get install -y redis-server"
        password = self.password_file.read_text().strip()
        # The password goes in through stdin (a config file read from "-"), not argv, which ps shows.
        config = (
            f"{self._tls_config()}bind 127.0.0.1\nrequirepass {password}\n"
            f'save ""\nappendonly no\ndir {self.directory}\n'
        )
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen([server, "-"], stdin=subprocess.PIPE, stdout=log, stderr=log)
        assert self.process.stdin is not None
        self.process.stdin.write(config.encode())
        self.process.stdin.close()
        client = self.client(password)
        for _ in range(200):  # bounded: up to about 10 s
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer: {(self.directory / 'redis.log').read_text()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


def running_store(tmp_path: Path, tls: tuple[PKI, Files, Files] | None = None) -> Iterator[RedisServer]:
    password_file = tmp_path / "ratelimit-store.password"
    password_file.write_text(secrets.token_urlsafe(24) + "\n")
    password_file.chmod(0o600)
    server = RedisServer(free_port(), password_file, tmp_path, tls=tls)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_store(tmp_path)


@pytest.fixture
def tls_store(tmp_path: Path) -> Iterator[RedisServer]:
    pki = PKI(tmp_path)
    yield from running_store(tmp_path, (pki, pki.files("redis"), pki.files("store-client", client=True)))


@pytest.fixture
def cluster(tmp_path: Path, kv_key_file: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, kv_key_file)
    cluster.start_scheduler()
    yield cluster
    cluster.stop()


def statuses(urls: list[str], count: int) -> list[int]:
    """`count` requests of tenant scarce, spread round-robin over the gateways at `urls`."""
    return [
        httpx.post(f"{urls[n % len(urls)]}/v1/completions", json=BODY, headers=AUTH, timeout=30).status_code
        for n in range(count)
    ]


def shared_gauge(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "pdserve_gateway_rate_limit_shared")


def test_two_replicas_sharing_the_store_give_the_limit_once(store: RedisServer, cluster: Cluster) -> None:
    flags = ("--rate-limit-storage", store.url, "--rate-limit-password-file", str(store.password_file))
    urls = [cluster.start_gateway(*flags).url, cluster.start_gateway(*flags).url]
    assert [shared_gauge(url) for url in urls] == [1, 1]
    got = statuses(urls, 8)
    assert got.count(429) == 5 and got.count(503) == 3, got  # 3 admitted in all, not 3 per replica

    refused = httpx.post(f"{urls[0]}/v1/completions", json=BODY, headers=AUTH)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1

    store.kill()  # the store goes away: each replica limits on its own, and says so
    for url in urls:
        got = statuses([url], 4)
        assert got == [503, 503, 503, 429], got
        assert shared_gauge(url) == 0
    for gateway in cluster.gateways:
        assert "rate-limit store failed" in gateway.logs()
        assert store.password_file.read_text().strip() not in gateway.logs()

    store.start()  # back: the replicas share again once their background probe finds it, with no request needed
    deadline = time.monotonic() + 30  # bounded: the probe runs every 5 s
    while time.monotonic() < deadline:
        if [shared_gauge(url) for url in urls] == [1, 1]:
            break
        time.sleep(0.05)
    assert [shared_gauge(url) for url in urls] == [1, 1]
    got = statuses(urls, 8)
    assert got.count(429) == 5 and got.count(503) == 3, got  # the store came back empty: 3 admitted in all again


def test_a_store_refusing_the_password_means_per_process_limits(
    store: RedisServer, cluster: Cluster, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    url = cluster.start_gateway("--rate-limit-storage", store.url, "--rate-limit-password-file", str(wrong)).url
    assert shared_gauge(url) == 0
    assert statuses([url], 4) == [503, 503, 503, 429]
    assert "rate-limit store" in cluster.gateways[0].logs()


def test_memory_storage_is_per_process(cluster: Cluster) -> None:
    urls = [cluster.start_gateway().url, cluster.start_gateway().url]
    assert [shared_gauge(url) for url in urls] == [0, 0]
    got = statuses(urls, 8)
    assert got.count(503) == 6, got  # each replica gives the whole limit: why a shared store exists


def test_replicas_share_the_limit_through_a_tls_store_requiring_client_certificates(
    tls_store: RedisServer, cluster: Cluster
) -> None:
    assert tls_store.tls is not None
    pki, _, _ = tls_store.tls
    pair = pki.files("gateway-client", client=True)
    store = ("--rate-limit-storage", tls_store.url, "--rate-limit-password-file", str(tls_store.password_file))
    tls = ("--tls-ca", str(pki.ca_file), "--tls-client-cert", str(pair.cert), "--tls-client-key", str(pair.key))
    urls = [cluster.start_gateway(*store, *tls).url, cluster.start_gateway(*store, *tls).url]
    assert [shared_gauge(url) for url in urls] == [1, 1]
    got = statuses(urls, 8)
    assert got.count(429) == 5 and got.count(503) == 3, got  # 3 admitted in all, counted in the TLS store
    password = tls_store.password_file.read_text().strip()
    assert any(key.startswith(b"LIMITS:") for key in tls_store.client(password).scan_iter())

    # Trusting the CA but presenting no client certificate: the store refuses the handshake, so this replica limits
    # on its own (the per-process fallback), and says so.
    alone = cluster.start_gateway(*store, "--tls-ca", str(pki.ca_file)).url
    assert shared_gauge(alone) == 0
    assert statuses([alone], 4) == [503, 503, 503, 429]
    assert "rate-limit store" in cluster.gateways[-1].logs()
    assert password not in cluster.gateways[-1].logs()
