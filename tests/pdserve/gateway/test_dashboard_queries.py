"""Every dashboard query against the real components: their metric names, and a real Prometheus that scraped them.

A scheduler, a prefill and a decode server (pdserve engine), a gateway and node_exporter run on loopback; a real
Prometheus scrapes them with the labels the deployed scrape configs set (job per component, datacenter, role) and,
as deployed, presents the gateway's metrics token; the test sends traffic through the gateway, then runs every
panel's queries over the scraped data.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdstack.contract.components import NODE_JOB, Component
from pdstack.dashboards.promql import metric_names
from tests.support.cluster import HTTP, KEYS, Cluster
from tests.support.dashboardcheck import VLLM_PREFIX, dashboard_queries, query_problems
from tests.support.ports import free_port
from tests.support.process import Daemon
from tests.support.prometheus import scraping

AUTH = {"Authorization": f"Bearer {KEYS['bulk']}"}
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
    "gauge": ("",),
    "unknown": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket",),
}


@dataclass
class Observed:
    prometheus: str
    scrapes: dict[str, str]  # job -> /metrics text


def registered_sample_names(text: str) -> set[str]:
    """Every sample name a scrape may carry, from its families' TYPE lines (so a labelled counter that has not
    counted anything yet still counts as registered)."""
    return {family.name + suffix for family in text_string_to_metric_families(text) for suffix in SUFFIXES[family.type]}


def start_node_exporter(log: Path) -> Daemon:
    binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    assert binary, "node_exporter is not installed: apt-get install prometheus-node-exporter"
    port = free_port()
    argv = [binary, f"--web.listen-address=127.0.0.1:{port}"]
    return Daemon("node_exporter", argv, f"http://127.0.0.1:{port}", log, ready_path="/metrics").start()


def send_traffic(gateway: str) -> None:
    def complete(i: int) -> int:
        body = {
            "model": "dense",
            "prompt": f"request {i} crosses from prefill to decode",
            "max_tokens": 6,
            "stream": i % 2 == 0,
        }
        return HTTP.post(f"{gateway}/v1/completions", json=body, headers=AUTH).status_code

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(complete, range(16))) == [200] * 16


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, model_v1: Path) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("dashboards")
    cluster = Cluster(tmp, kv_key_file)
    node_exporter = start_node_exporter(tmp / "node_exporter.log")
    try:
        gateway = cluster.start_pd(
            [("p1", "prefill", model_v1, "v1"), ("d1", "decode", model_v1, "v1")],
            "--offload-threshold-tokens",
            "0",
            "--requests-per-second",
            "1000",
            *cluster.metrics_flags(),  # as deployed: Prometheus presents the gateway's metrics token
        )
        assert cluster.scheduler is not None
        weights = httpx.put(
            f"{cluster.scheduler.url}/v1/admin/weights",
            json={"weights": {"v1": 1.0}},
            headers={"Authorization": f"Bearer {cluster.admin_token}"},
        )  # as a canary rollout does
        assert weights.status_code == 200, weights.text
        verdict = httpx.post(
            f"{cluster.scheduler.url}/v1/admin/canary/verdicts",
            json={"canary": "v1", "baseline": "v0", "step_percent": 100, "outcome": "pass"},
            headers={"Authorization": f"Bearer {cluster.admin_token}"},
        )  # as deploy.yml records each step's verdict
        assert verdict.status_code == 200, verdict.text
        control = {"datacenter": "dc-control", "role": "control", "pool": "control"}
        targets = {
            Component.GATEWAY.job: (gateway.url, control),
            Component.SCHEDULER.job: (cluster.scheduler.url, control),
            Component.PREFILL.job: (
                cluster.servers["p1"].url,
                {"datacenter": "dc-a", "role": "prefill", "pool": "prefill"},
            ),
            Component.DECODE.job: (
                cluster.servers["d1"].url,
                {"datacenter": "dc-b", "role": "decode", "pool": "decode"},
            ),
            NODE_JOB: (node_exporter.url, {}),
        }
        gateway_job = Component.GATEWAY.job
        with scraping(tmp, targets, {gateway_job: cluster.metrics_token_file}) as url:
            send_traffic(gateway.url)
            time.sleep(5)  # a few scrapes after the traffic, so rates over the last minute have two points
            scrapes = {
                job: httpx.get(target + "/metrics", headers=cluster.metrics_auth() if job == gateway_job else {}).text
                for job, (target, _) in targets.items()
            }
            yield Observed(url, scrapes)
    finally:
        node_exporter.stop()
        cluster.stop()


def test_every_metric_a_panel_uses_is_registered_by_a_component(observed: Observed) -> None:
    """vllm: names are vLLM's own: tests/vllm/test_dashboard_metrics.py checks them against vLLM's registrations."""
    registered = set().union(*map(registered_sample_names, observed.scrapes.values()))
    unknown = sorted(
        {
            (board, title, name)
            for board, title, exprs in dashboard_queries()
            for expr in exprs
            for name in metric_names(expr)
            if name not in registered and not name.startswith(VLLM_PREFIX)
        }
    )
    assert unknown == []


def test_every_panel_query_runs_and_returns_series(observed: Observed) -> None:
    """Each query succeeds; each one over pdserve's or node_exporter's metrics returns series (a label or selector
    that matches nothing would return none). Queries over vllm: metrics return none here: no vLLM runs."""
    problems = query_problems(observed.prometheus, window_s=60, step_s=2)
    assert problems == [], "\n".join(problems)
