"""Gateway overhead: the same requests sent straight to a colocated server and through the gateway, in one run.

Starts a scheduler, a `pdserve colocated` server on a tiny test checkpoint (registered with the scheduler) and a
gateway in front of it, all on loopback, then alternates rounds of identical non-streaming completions against both
targets: latency at concurrency 1 (p50/p99, and what the gateway adds) and sustained requests/s at concurrency 8.
Every figure is reported against the direct baseline measured in the same run.

    .venv/bin/python bench/gateway_overhead.py [--requests 400] [--out bench/results/gateway_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.scheduler.identity import derive_token

API_KEY = "sk-bench-" + secrets.token_hex(8)
BODY = {
    "model": "bench",
    "prompt": "The quick brown fox jumps over the lazy dog",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}
Send = Callable[[httpx.AsyncClient], Awaitable[None]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=out)


def wait_ok(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def start_stack(work: Path) -> tuple[list[subprocess.Popen[bytes]], str, str]:
    model = make_test_checkpoint("dense", work / "model")
    identity, engine_id = secrets.token_hex(32), secrets.token_hex(16)
    tokens = {
        "admin.token": secrets.token_hex(16),
        "identity.key": identity,
        "server.token": secrets.token_hex(16),
        "colocated.token": derive_token(identity, f"instance:colocated-{engine_id[:24]}"),
        "gateway.token": derive_token(identity, "gateway"),
    }
    for name, value in tokens.items():
        (work / name).write_text(value)
    (work / "keys.json").write_text(json.dumps({"bench": [API_KEY]}))
    sched_port, server_port, gateway_port = free_port(), free_port(), free_port()
    scheduler_url = f"http://127.0.0.1:{sched_port}"
    procs = [
        launch(
            [
                "pdserve.scheduler",
                "--port",
                str(sched_port),
                "--state-file",
                str(work / "state.json"),
                "--admin-token-file",
                str(work / "admin.token"),
                "--identity-key-file",
                str(work / "identity.key"),
                "--heartbeat-interval",
                "1",
            ],
            work / "scheduler.log",
        )
    ]
    wait_ok(scheduler_url + "/health/live")
    procs.append(
        launch(
            [
                "pdserve.cli",
                "colocated",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(server_port),
                "--served-model-name",
                "bench",
                "--scheduler-url",
                scheduler_url,
                "--engine-id",
                engine_id,
                "--scheduler-token-file",
                str(work / "colocated.token"),
                "--heartbeat-seconds",
                "1",
            ],
            work / "colocated.log",
        )
    )
    procs.append(
        launch(
            [
                "pdserve.gateway",
                "--port",
                str(gateway_port),
                "--scheduler-url",
                scheduler_url,
                "--scheduler-token-file",
                str(work / "gateway.token"),
                "--server-token-file",
                str(work / "server.token"),
                "--api-keys-file",
                str(work / "keys.json"),
                "--requests-per-second",
                "100000",
                "--request-burst",
                "100000",
                "--tokens-per-minute",
                "100000000",
                "--log-level",
                "warning",
            ],
            work / "gateway.log",
        )
    )
    server_url, gateway_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{gateway_port}"
    wait_ok(server_url + "/health/ready")
    wait_ok(gateway_url + "/health/ready")
    return procs, server_url, gateway_url


def completion(url: str, key: str = API_KEY) -> Send:
    """One completion (BODY) sent to `url`."""

    async def send(client: httpx.AsyncClient) -> None:
        response = await client.post(url + "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
        response.raise_for_status()

    return send


async def run_round(
    client: httpx.AsyncClient, send: Send, requests: int, concurrency: int
) -> tuple[list[float], float]:
    """`requests` sends with `concurrency` in flight; returns each latency and the wall time."""
    latencies: list[float] = []
    queue = iter(range(requests))

    async def worker() -> None:
        for _ in queue:
            started = time.perf_counter()
            await send(client)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


async def measure(targets: dict[str, str], requests: int, rounds: int) -> dict[str, Any]:
    latency: dict[str, list[float]] = {name: [] for name in targets}
    throughput: dict[str, list[float]] = {name: [] for name in targets}
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        sends = {name: completion(url) for name, url in targets.items()}
        for send in sends.values():  # warm up connections, the engine and the gateway's routing
            await run_round(client, send, 20, 4)
        per_round = max(1, requests // rounds)
        for _ in range(rounds):  # alternate so that drift on the machine hits both alike
            for name, send in sends.items():
                lat, _ = await run_round(client, send, per_round, 1)
                latency[name].extend(lat)
                _, wall = await run_round(client, send, per_round, 8)
                throughput[name].append(per_round / wall)
    return summarise(latency, throughput)


def target_stats(latency: dict[str, list[float]], rates: dict[str, list[float]], rate: str) -> dict[str, Any]:
    """Per target: latency p50/p99 in ms, the median of its rounds' request rates (as `rate`), the sample count."""
    return {
        name: {
            "p50_ms": percentile(lat, 50) * 1e3,
            "p99_ms": percentile(lat, 99) * 1e3,
            rate: statistics.median(rates[name]),
            "samples": len(lat),
        }
        for name, lat in latency.items()
    }


def summarise(latency: dict[str, list[float]], throughput: dict[str, list[float]]) -> dict[str, Any]:
    stats = target_stats(latency, throughput, "requests_per_second_c8")
    direct, gateway = stats["direct"], stats["gateway"]
    return {
        "direct": direct,
        "gateway": gateway,
        "added_p50_ms": gateway["p50_ms"] - direct["p50_ms"],
        "added_p99_ms": gateway["p99_ms"] - direct["p99_ms"],
        "p50_ratio": gateway["p50_ms"] / direct["p50_ms"],
        "p99_ratio": gateway["p99_ms"] / direct["p99_ms"],
        "throughput_ratio": gateway["requests_per_second_c8"] / direct["requests_per_second_c8"],
    }


def arguments(description: str | None, requests: int, out: str) -> argparse.Namespace:
    """A bench's command line: requests per target and level, rounds, where the JSON goes."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=requests, help="requests per target and concurrency level")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds the requests are split into")
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser.parse_args()


def main() -> None:
    args = arguments(__doc__, 400, "bench/results/gateway_overhead.json")
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        procs, server_url, gateway_url = start_stack(Path(tmp))
        try:
            result = asyncio.run(measure({"direct": server_url, "gateway": gateway_url}, args.requests, args.rounds))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(10)
    result["setup"] = {
        "workload": "non-streaming /v1/completions, 8 generated tokens, tiny dense test checkpoint",
        "latency_concurrency": 1,
        "throughput_concurrency": 8,
        "requests": args.requests,
        "rounds": args.rounds,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "note": "client, gateway, scheduler and server share this machine's cores",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
