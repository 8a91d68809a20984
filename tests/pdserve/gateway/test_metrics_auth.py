"""The gateway's /metrics requires its metrics token (#33 item 10): its series name tenants, versions and instances,
and the gateway is the one listener clients reach. Real gateway processes on loopback, beside a real scheduler.

The probes stay open; a token-less gateway may serve /metrics openly only on a loopback address, and refuses to
start anywhere else.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.scheduler.client import bearer
from tests.support.cluster import KEYS, Cluster, metric
from tests.support.ports import free_port
from tests.support.services import gateway_token_file


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("gateway-metrics-auth"), kv_key_file)
    try:
        cluster.start_scheduler()
        cluster.start_gateway(*cluster.metrics_flags())  # gateways[0]: /metrics requires the token
        cluster.start_gateway()  # gateways[1]: none given, on loopback
        # one request of tenant acme, so its name is among the series
        models = httpx.get(f"{cluster.gateways[0].url}/v1/models", headers=bearer(KEYS["acme"]))
        assert models.status_code == 200, models.text
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    ("presented", "problem"),
    [
        ({}, "missing"),
        (bearer("not-the-metrics-token"), "wrong"),
        (bearer(KEYS["acme"]), "wrong"),  # a tenant's API key is no metrics credential
        ({"Authorization": "Basic bWV0cmljczp4"}, "wrong"),
    ],
    ids=["none", "wrong-token", "api-key", "basic"],
)
def test_metrics_refuse_a_caller_without_the_token(cluster: Cluster, presented: dict[str, str], problem: str) -> None:
    response = httpx.get(f"{cluster.gateways[0].url}/metrics", headers=presented)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["param"] == "authorization"
    assert error["message"].startswith(f"authorization: {problem} metrics token")
    assert "pdserve_gateway" not in response.text
    assert "acme" not in response.text


def test_metrics_serve_the_holder_of_the_token(cluster: Cluster) -> None:
    response = httpx.get(f"{cluster.gateways[0].url}/metrics", headers=cluster.metrics_auth())
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    assert metric(response.text, "pdserve_gateway_requests_total", endpoint="models", tenant="acme") == 1


def test_probes_stay_open(cluster: Cluster) -> None:
    assert httpx.get(f"{cluster.gateways[0].url}/health/live").status_code == 200
    ready = httpx.get(f"{cluster.gateways[0].url}/health/ready")  # 503: no decode instance, but answered
    assert ready.status_code in (200, 503), ready.text
    assert "routing_generation" in ready.json()


def test_a_loopback_gateway_without_a_token_serves_metrics(cluster: Cluster) -> None:
    response = httpx.get(f"{cluster.gateways[1].url}/metrics")
    assert response.status_code == 200, response.text
    assert "pdserve_gateway_requests_total" in response.text


def _start(tmp: Path, cluster: Cluster, *flags: str) -> subprocess.CompletedProcess[str]:
    """A gateway process given `flags` after the usual ones; it is expected to exit at once (the timeout fails)."""
    assert cluster.scheduler is not None
    keys = tmp / "keys.json"
    keys.write_text('{"acme": ["sk-x"]}')
    argv = [
        sys.executable,
        "-m",
        "pdserve.gateway",
        "--port",
        str(free_port()),
        "--scheduler-url",
        cluster.scheduler.url,
        "--scheduler-token-file",
        str(gateway_token_file(cluster.tmp)),
        "--server-token-file",
        str(cluster.server_token_file),
        "--api-keys-file",
        str(keys),
        *flags,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_a_gateway_without_a_token_refuses_to_start_on_a_non_loopback_address(cluster: Cluster, tmp_path: Path) -> None:
    started = _start(tmp_path, cluster, "--host", "0.0.0.0", "--allow-plaintext", "true")
    assert started.returncode == 2, started.stdout + started.stderr
    assert "metrics_token_file: without a metrics token" in started.stderr
    assert "0.0.0.0" in started.stderr


def test_an_empty_token_file_stops_the_start(cluster: Cluster, tmp_path: Path) -> None:
    empty = tmp_path / "metrics.token"
    empty.write_text("\n")
    started = _start(tmp_path, cluster, "--host", "127.0.0.1", "--metrics-token-file", str(empty))
    assert started.returncode == 1, started.stdout + started.stderr
    assert f"pdserve gateway: invalid configuration: metrics_token_file {empty} is empty" in started.stderr
    assert "Traceback" not in started.stderr


def test_the_token_itself_is_never_logged(cluster: Cluster) -> None:
    token = cluster.metrics_token_file.read_text().strip()
    httpx.get(f"{cluster.gateways[0].url}/metrics", headers=bearer(token + "x"))
    httpx.get(f"{cluster.gateways[0].url}/metrics", headers=cluster.metrics_auth())
    assert token not in cluster.gateways[0].logs()
