"""Versions and weights on real processes: v1 and v2 (other weights, other KV fingerprint) side by side.

Pairs are never mixed across versions, admin-set weights split the traffic, and the weights survive a scheduler
restart while the servers register again by themselves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from scipy.stats import binomtest

from tests.support.cluster import HTTP, KEYS, Cluster, metric, wait_for

PROMPT = "The quick brown fox jumps over the lazy dog near the river bank at dawn"
AUTH = {"Authorization": f"Bearer {KEYS['bulk']}"}  # limits far above these tests: they measure routing
NAMES = {"pa": ("prefill", "v1"), "da": ("decode", "v1"), "pb": ("prefill", "v2"), "db": ("decode", "v2")}


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, model_v1: Path, model_v2: Path
) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("gateway-versions"), kv_key_file)
    try:
        servers = [
            (name, role, model_v1 if version == "v1" else model_v2, version) for name, (role, version) in NAMES.items()
        ]
        cluster.start_pd(servers, "--offload-threshold-tokens", "0", "--requests-per-second", "1000")
        yield cluster
    finally:
        cluster.stop()


def complete(url: str) -> int:
    """A completion through the gateway at `url`; the first gateway sends every prompt to remote prefill."""
    body = {"model": "dense", "prompt": PROMPT, "max_tokens": 1}
    return HTTP.post(f"{url}/v1/completions", json=body, headers=AUTH).status_code


def set_weights(cluster: Cluster, weights: dict[str, float]) -> None:
    assert cluster.scheduler is not None
    response = httpx.put(
        f"{cluster.scheduler.url}/v1/admin/weights",
        json={"weights": weights},
        headers={"Authorization": f"Bearer {cluster.admin_token}"},
    )
    assert response.status_code == 200, response.text
    cluster.sync(cluster.gateways[0])


def request_lines(cluster: Cluster) -> list[str]:
    return [line for line in cluster.gateways[0].logs().splitlines() if '"message": "request"' in line]


def test_versions_are_never_mixed_in_a_pair(cluster: Cluster) -> None:
    url = cluster.gateways[0].url
    version_of = {cluster.instance_id(name): version for name, (_, version) in NAMES.items()}
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: complete(url), range(40))) == [200] * 40
    # The access line is written once the response is sent, so the last ones may follow the responses a little.
    wait_for(lambda: len(request_lines(cluster)) == 40, what="40 request lines in the gateway log")
    logs = [json.loads(line) for line in cluster.gateways[0].logs().splitlines() if line.startswith("{")]
    requests = [line for line in logs if line["message"] == "request"]
    # A request whose prefill failed may fall back to prefilling on its decode instance (route
    # no_prefill_available, prefill None): that is the gateway's designed fallback, not a mixed pair.
    remote = [line for line in requests if line["prefill"] is not None]
    fallbacks = [line for line in requests if line["prefill"] is None]
    warnings = [line for line in logs if line["level"] == "warning"]
    assert all(line["route"] == "no_prefill_available" for line in fallbacks), (fallbacks, warnings)
    pairs = [(version_of[line["prefill"]], version_of[line["decode"]]) for line in remote]
    assert set(pairs) == {("v1", "v1"), ("v2", "v2")}, ("both versions serve, each with its own prefill", warnings)
    for name in ("da", "db"):
        failures = metric(httpx.get(f"{cluster.servers[name].url}/metrics").text, "pdserve_kv_load_failures_total")
        assert failures == 0


def test_weights_90_10_split_the_traffic(cluster: Cluster) -> None:
    # Versions are chosen before the offload decision, so a gateway that prefills everything on decode splits
    # traffic the same way, and many requests are cheap.
    gateway = cluster.start_gateway("--offload-threshold-tokens", "100000", "--requests-per-second", "1000")
    cluster.wait_routable(gateway, 4)
    url = gateway.url
    set_weights(cluster, {"v1": 90, "v2": 10})
    cluster.sync(gateway)
    before = {name: cluster.served(name) for name in ("da", "db")}
    total = 300
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda _: complete(url), range(total))) == [200] * total
    v1, v2 = (cluster.served(name) - before[name] for name in ("da", "db"))
    assert v1 + v2 == total
    # Two-sided exact binomial test of the v2 share against 10 %: fails by chance one time in 10 000.
    assert binomtest(int(v2), total, 0.10).pvalue > 1e-4, (v1, v2)
    set_weights(cluster, {"v1": 1, "v2": 0})
    before_v2 = cluster.served("db")
    assert [complete(url) for _ in range(20)] == [200] * 20
    assert cluster.served("db") == before_v2, "a version at weight 0 got traffic"


def test_scheduler_restart_keeps_weights_and_servers_come_back(cluster: Cluster) -> None:
    assert cluster.scheduler is not None
    set_weights(cluster, {"v1": 90, "v2": 10})
    cluster.scheduler.kill()
    cluster.scheduler.start()  # same port, same state file, empty registry
    routing = httpx.get(f"{cluster.scheduler.url}/v1/routing", headers=cluster.gateway_auth()).json()
    assert routing["weights"] == {"v1": 90, "v2": 10}
    cluster.wait_routable(cluster.gateways[0], 4)  # every server registered again on its own
    assert complete(cluster.gateways[0].url) == 200
