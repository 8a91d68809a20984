"""The pdstack gateway against vllm-router, in front of the same pdserve prefill and decode, in one run.

Starts a scheduler, `pdserve prefill` and `pdserve decode` on a tiny test checkpoint (registered with the scheduler),
then two routers in front of that pair: the pdstack gateway (every prompt sent to remote prefill, so both routers run
the same prefill -> decode flow) and `vllm-router --vllm-pd-disaggregation`. Rounds of identical non-streaming
completions alternate between the two at 1, 16 and 64 concurrent clients: latency p50/p99 and requests/s of each, the
latency the gateway adds over vllm-router, and the gateway's figures as ratios to vllm-router's.

(A client running the two calls itself is no baseline here: from Python its two requests cost more than either
router's hop, so the added latency is measured between the routers, on the same backends in the same run.)

    .venv/bin/python bench/gateway_vs_vllm_router.py [--requests 480] [--out bench/results/gateway_vs_vllm_router.json]
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from gateway_overhead import API_KEY, Send, arguments, completion, free_port, launch, run_round, target_stats, wait_ok

from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.scheduler.identity import derive_token

CONCURRENCY = (1, 16, 64)
VLLM_ROUTER = Path(sys.executable).with_name("vllm-router")


def secret(path: Path, value: str) -> Path:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


def start_backends(work: Path) -> tuple[list[subprocess.Popen[bytes]], dict[str, str], Path, Path]:
    """Scheduler, prefill and decode; returns the processes, their URLs, the gateway's and the servers' token files."""
    model = make_test_checkpoint("dense", work / "model")
    identity = secrets.token_hex(32)
    secret(work / "identity.key", identity)
    secret(work / "admin.token", secrets.token_hex(16))
    secret(work / "kv.key", secrets.token_hex(32))
    server_token = secret(work / "server.token", secrets.token_hex(16))
    urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("scheduler", "prefill", "decode")}
    procs = [
        launch(
            [
                "pdserve.scheduler",
                "--port",
                urls["scheduler"].rsplit(":", 1)[1],
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
    wait_ok(urls["scheduler"] + "/health/live")
    for role in ("prefill", "decode"):
        engine_id = secrets.token_hex(16)
        token = secret(work / f"{role}.scheduler.token", derive_token(identity, f"instance:{role}-{engine_id[:24]}"))
        extra = ["--kv-port", "0"] if role == "prefill" else []
        procs.append(
            launch(
                [
                    "pdserve.cli",
                    role,
                    "--model",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    urls[role].rsplit(":", 1)[1],
                    "--served-model-name",
                    "bench",
                    "--engine-id",
                    engine_id,
                    "--kv-key-file",
                    str(work / "kv.key"),
                    "--api-token-file",
                    str(server_token),
                    "--scheduler-url",
                    urls["scheduler"],
                    "--scheduler-token-file",
                    str(token),
                    "--heartbeat-seconds",
                    "1",
                    "--max-num-seqs",
                    "128",
                    "--log-level",
                    "warning",
                    *extra,
                ],
                work / f"{role}.log",
            )
        )
    for role in ("prefill", "decode"):
        wait_ok(urls[role] + "/health/ready", timeout=180)
    gateway_token = secret(work / "gateway.scheduler.token", derive_token(identity, "gateway"))
    return procs, urls, gateway_token, server_token


def start_gateway(work: Path, scheduler_url: str, gateway_token: Path, server_token: Path) -> tuple[Any, str]:
    (work / "keys.json").write_text(json.dumps({"bench": [API_KEY]}))
    port = free_port()
    proc = launch(
        [
            "pdserve.gateway",
            "--port",
            str(port),
            "--scheduler-url",
            scheduler_url,
            "--scheduler-token-file",
            str(gateway_token),
            "--server-token-file",
            str(server_token),
            "--api-keys-file",
            str(work / "keys.json"),
            "--offload-threshold-tokens",
            "0",
            "--requests-per-second",
            "100000",
            "--request-burst",
            "100000",
            "--tokens-per-minute",
            "1000000000",
            "--log-level",
            "warning",
        ],
        work / "gateway.log",
    )
    url = f"http://127.0.0.1:{port}"
    wait_ok(url + "/health/live")
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health/ready", timeout=2).json().get("instances", 0) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway never listed prefill and decode")
        time.sleep(0.2)
    return proc, url


def start_vllm_router(work: Path, prefill_url: str, decode_url: str, server_token: Path) -> tuple[Any, str]:
    port = free_port()
    command = [
        str(VLLM_ROUTER),
        "--vllm-pd-disaggregation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        prefill_url,
        "--decode",
        decode_url,
        "--policy",
        "round_robin",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "OPENAI_API_KEY": server_token.read_text().strip()}  # what it presents to the servers
    with (work / "vllm-router.log").open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ok(url + "/health")
    return proc, url


async def measure(targets: dict[str, Send], requests: int, rounds: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        for send in targets.values():  # warm up connections, engines and the gateway's routing
            await run_round(client, send, 32, 8)
        for concurrency in CONCURRENCY:
            latency: dict[str, list[float]] = {name: [] for name in targets}
            rates: dict[str, list[float]] = {name: [] for name in targets}
            per_round = max(concurrency, requests // rounds)
            for _ in range(rounds):  # alternate so that drift on the machine hits every target alike
                for name, send in targets.items():
                    lat, wall = await run_round(client, send, per_round, concurrency)
                    latency[name].extend(lat)
                    rates[name].append(per_round / wall)
            results[f"c{concurrency}"] = summarise(latency, rates)
    return results


def summarise(latency: dict[str, list[float]], rates: dict[str, list[float]]) -> dict[str, Any]:
    stats = target_stats(latency, rates, "requests_per_second")
    gateway, router = stats["gateway"], stats["vllm_router"]
    return {
        **stats,
        "gateway_added_p50_ms": gateway["p50_ms"] - router["p50_ms"],
        "gateway_added_p99_ms": gateway["p99_ms"] - router["p99_ms"],
        "gateway_over_vllm_router": {
            "p50": gateway["p50_ms"] / router["p50_ms"],
            "p99": gateway["p99_ms"] / router["p99_ms"],
            "requests_per_second": gateway["requests_per_second"] / router["requests_per_second"],
        },
    }


def main() -> None:
    args = arguments(__doc__, 480, "bench/results/gateway_vs_vllm_router.json")
    load_at_start = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        work = Path(tmp)
        procs, urls, gateway_token, server_token = start_backends(work)
        try:
            gateway, gateway_url = start_gateway(work, urls["scheduler"], gateway_token, server_token)
            procs.append(gateway)
            router, router_url = start_vllm_router(work, urls["prefill"], urls["decode"], server_token)
            procs.append(router)
            targets = {
                "gateway": completion(gateway_url, API_KEY),
                "vllm_router": completion(router_url, "unused"),
            }
            result = asyncio.run(measure(targets, args.requests, args.rounds))
        except BaseException:
            for log in sorted(work.glob("*.log")):  # the work directory goes away with the error
                print(
                    f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-5:]), file=sys.stderr
                )
            raise
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                proc.wait(10)
    result["setup"] = {
        "workload": "non-streaming /v1/completions, 8 generated tokens, tiny dense test checkpoint, every request "
        "prefilled remotely (gateway --offload-threshold-tokens 0)",
        "vllm_router": "vllm-router 0.1.17 --vllm-pd-disaggregation --policy round_robin",
        "concurrency": list(CONCURRENCY),
        "requests": args.requests,
        "rounds": args.rounds,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average_at_start": load_at_start,
        "note": "client, routers, scheduler and servers share this machine's cores (and, on a shared box, other "
        "work: see load_average_at_start); gateway_added = gateway - vllm_router",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
