"""The cloud's rate-limit store for real: Debian's redis-server started with the redis.conf the program renders (its
TLS files, the Secret's, put here) serves the gateway's client options over TLS, and refuses a client without a
certificate from the CA and a plaintext one."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from infra.workloads.ratelimit_store import ratelimit_store_config
from pdserve.common.tls import TLSClientSettings
from pdserve.gateway.ratelimit import store_ssl_options
from pdstack.contract.components import TLS_DIR
from pdstack.local.tls import Leaf, LocalCA
from tests.support.ports import free_port

from .conftest import mounted_tls

REDIS = shutil.which("redis-server")
PASSWORD = "store-password-for-this-test"
STORE, GATEWAY = "localhost", "gateway"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, LocalCA]]:
    assert REDIS is not None, "apt-get install redis-server"
    tmp = tmp_path_factory.mktemp("ratelimit-tls")
    ca = LocalCA(tmp / "tls")
    ca.ensure([Leaf(STORE, (STORE,), ("127.0.0.1",)), Leaf(GATEWAY, ("gateway.test",), ())])
    served = mounted_tls(ca, STORE, tmp / "run-tls")
    port = free_port()
    conf = (
        ratelimit_store_config(PASSWORD, port).replace(TLS_DIR, str(served)).replace("bind 0.0.0.0", "bind 127.0.0.1")
    )
    (tmp / "redis.conf").write_text(conf)
    process = subprocess.Popen([REDIS, str(tmp / "redis.conf"), "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and ping(port, ca, client=True) is not True:
            assert process.poll() is None, "redis-server exited"
            time.sleep(0.1)
        yield port, ca
    finally:
        process.terminate()
        process.wait(10)


def ping(port: int, ca: LocalCA, *, client: bool, password: str = PASSWORD) -> bool | Exception:
    tls = TLSClientSettings(
        tls_ca=ca.ca_cert,
        tls_client_cert=ca.cert(GATEWAY) if client else None,
        tls_client_key=ca.key(GATEWAY) if client else None,
    )
    connection = redis.Redis(
        host=STORE, port=port, password=password, ssl=True, socket_timeout=5, **store_ssl_options(tls)
    )
    try:
        return bool(connection.ping())
    except (redis.RedisError, OSError) as exc:
        return exc
    finally:
        connection.close()


def test_the_gateways_tls_options_and_password_reach_the_store(store: tuple[int, LocalCA]) -> None:
    port, ca = store
    assert ping(port, ca, client=True) is True
    assert isinstance(ping(port, ca, client=True, password="wrong"), redis.AuthenticationError)


def test_a_client_without_a_certificate_from_the_ca_is_refused(store: tuple[int, LocalCA]) -> None:
    port, ca = store
    assert isinstance(ping(port, ca, client=False), redis.ConnectionError)


def test_plaintext_gets_no_answer(store: tuple[int, LocalCA]) -> None:
    port, _ = store
    plain = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=5)
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        plain.ping()
    plain.close()
