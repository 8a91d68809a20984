"""`pdstack bench` through the pdstack gateway (scheduler, prefill and decode behind it, real processes on loopback):
an API key from a file, and percentiles that agree with the gateway's own Prometheus histograms, read with the
gateway's metrics token as deployed gateways require."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.serverproc import ServerProcess, api_token_file
from tests.support.services import Service, gateway_token_file, instance_token_file, start_scheduler

from .conftest import BenchRunner, bench_process

GATEWAY_TTFT = "pdserve_gateway_time_to_first_token_seconds"
GATEWAY_E2E = "pdserve_gateway_request_duration_seconds"
LOW_RATE = ["--rate", "1", "--requests", "12", "--workload", "short", "--max-tokens", "16", "--seed", "5"]


@dataclass
class Gateway:
    url: str
    api_key: str
    api_key_file: Path
    metrics_token_file: Path

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"


def _wait_for_both_roles(gateway: Service, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = httpx.get(f"{gateway.url}/health/ready", timeout=2.0)
        if answer.status_code == 200 and answer.json()["instances"] >= 2:
            return
        time.sleep(0.2)
    raise RuntimeError(f"gateway never saw prefill and decode: {answer.text}")


@pytest.fixture(scope="module")
def gateway(bench_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("pd-stack")
    (work / "kv.key").write_text(secrets.token_hex(32))
    api_key = f"sk-bench-{secrets.token_hex(12)}"
    (work / "api.key").write_text(api_key + "\n")
    (work / "metrics.token").write_text(secrets.token_urlsafe(24) + "\n")
    (work / "keys.json").write_text(
        json.dumps(
            {
                "bench": {
                    "keys": [api_key],
                    "requests_per_second": 1000,
                    "request_burst": 1000,
                    "tokens_per_minute": 10**9,
                }
            }
        )
    )
    scheduler, _ = start_scheduler(work, heartbeat_interval=1.0, missed=10)
    started: list[Service | ServerProcess] = [scheduler]
    try:
        for role, extra in (("prefill", ["--kv-port", "0"]), ("decode", [])):
            engine_id = secrets.token_hex(16)
            token = instance_token_file(work, f"{role}-{engine_id[:24]}")  # the id the server registers as
            args = [
                "--kv-key-file",
                str(work / "kv.key"),
                "--scheduler-url",
                scheduler.url,
                "--engine-id",
                engine_id,
                "--scheduler-token-file",
                str(token),
                *extra,
            ]
            server = ServerProcess(role, bench_model, args, {}, work / f"{role}.log")
            started.append(server.start())
        for server in started[1:]:
            assert isinstance(server, ServerProcess)
            server.wait_ready()
        front = Service(
            "pdserve.gateway",
            [
                "--scheduler-url",
                scheduler.url,
                "--scheduler-token-file",
                str(gateway_token_file(work)),
                "--server-token-file",
                str(api_token_file()),
                "--api-keys-file",
                str(work / "keys.json"),
                "--metrics-token-file",
                str(work / "metrics.token"),
            ],
            work / "gateway.log",
        )
        started.append(front.start())
        _wait_for_both_roles(front)
        yield Gateway(front.url, api_key, work / "api.key", work / "metrics.token")
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture(scope="module")
def completions_run(gateway: Gateway, run_bench: BenchRunner) -> dict[str, Any]:
    return run_bench(
        gateway.url,
        *LOW_RATE,
        "--api",
        "completions",
        "--api-key-file",
        str(gateway.api_key_file),
        "--metrics-url",
        gateway.metrics_url,
        "--metrics-token-file",
        str(gateway.metrics_token_file),
    )


def checks_of(results: dict[str, Any], metric: str, measure: str) -> list[dict[str, Any]]:
    run = results["runs"][0]
    return [c for c in run["server_histograms"]["checks"] if c["metric"] == metric and c["measure"] == measure]


def test_bench_through_the_gateway_with_a_key_file(gateway: Gateway, completions_run: dict[str, Any]) -> None:
    run = completions_run["runs"][0]
    assert run["completed"] == run["requests"] == 12, run["errors"]
    assert completions_run["endpoint"]["api"] == "completions"
    assert gateway.api_key not in json.dumps(completions_run)
    assert gateway.api_key not in completions_run["stdout"]


def test_a_wrong_key_is_named(gateway: Gateway, run_bench: BenchRunner, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.key"
    wrong.write_text("sk-not-a-key\n")
    done = bench_process(gateway.url, *LOW_RATE, "--api-key-file", str(wrong))
    assert done.returncode == 2
    assert f"api-key-file: {gateway.url}/v1/models refused the credentials (HTTP 401)" in done.stderr
    assert "sk-not-a-key" not in done.stdout + done.stderr


def test_the_gateways_metrics_without_their_token_are_named(gateway: Gateway, tmp_path: Path) -> None:
    args = [*LOW_RATE, "--api-key-file", str(gateway.api_key_file), "--metrics-url", gateway.metrics_url]
    done = bench_process(gateway.url, *args)
    assert done.returncode == 2
    assert f"metrics-url: {gateway.metrics_url} answered 401: give the token it requires with --metrics-token-file" in (
        done.stderr
    )
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-metrics-token\n")
    done = bench_process(gateway.url, *args, "--metrics-token-file", str(wrong))
    assert done.returncode == 2 and "(this one was refused)" in done.stderr
    assert "not-the-metrics-token" not in done.stdout + done.stderr


@pytest.mark.parametrize(("metric", "measure"), [(GATEWAY_TTFT, "ttft"), (GATEWAY_E2E, "e2e")])
def test_percentiles_fall_in_the_gateways_histogram_buckets(
    completions_run: dict[str, Any], metric: str, measure: str
) -> None:
    run = completions_run["runs"][0]
    assert run["server_histograms"]["note"] is None  # the gateway counted exactly the bench's requests
    checks = checks_of(completions_run, metric, measure)
    assert [c["q"] for c in checks] == [50, 90, 99]
    # p99 of 12 requests is their maximum, one request's fate; p50 and p90 are what 12 requests can vouch for
    assert all(c["agrees"] for c in checks if c["q"] in (50, 90)), checks


def test_chat_ttft_falls_in_the_gateways_ttft_buckets(gateway: Gateway, run_bench: BenchRunner) -> None:
    results = run_bench(
        gateway.url,
        *LOW_RATE,
        "--api",
        "chat",
        "--api-key-file",
        str(gateway.api_key_file),
        "--metrics-url",
        gateway.metrics_url,
        "--metrics-token-file",
        str(gateway.metrics_token_file),
    )
    checks = checks_of(results, GATEWAY_TTFT, "ttft")
    assert checks and all(c["agrees"] for c in checks if c["q"] in (50, 90)), checks
