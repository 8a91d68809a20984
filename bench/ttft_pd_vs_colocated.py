"""Server-level benchmarks of pdserve, each a ratio measured in one run on this machine (loopback, real processes).

(2) TTFT through prefill -> decode against colocated, for 512, 2K and 8K-token prompts. PD TTFT is the prefill
    request (max_tokens=1, KV held under lease) plus decode's time to its first streamed token (KV pull over the
    loopback KV channel, verification, first step). Colocated TTFT is the time to the first streamed token.
(3) Decode tokens/s with 1, 4, 16 and 64 concurrent streaming clients against the decode server (each request's KV
    pulled from prefill first; only the decode phase is timed), and the ratio to 1 client: continuous batching
    must make it scale.

Usage: .venv/bin/python bench/ttft_pd_vs_colocated.py [--repeats 3] [--out bench/results/ttft_pd_vs_colocated.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.gateway.proxy import prefill_body

PROMPT_LENGTHS = (512, 2048, 8192)
CONCURRENCY = (1, 4, 16, 64)
DECODE_PROMPT_TOKENS = 32
DECODE_NEW_TOKENS = 64
# Bigger than the test models so the figures mean something, still CPU-cheap; context room for 8K prompts.
BENCH_MODEL = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "max_position_embeddings": 16384,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(role: str, model: Path, key: Path, logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "pdserve.cli",
        role,
        "--model",
        str(model),
        "--port",
        str(port),
        "--max-num-seqs",
        "128",
        "--log-level",
        "warning",
    ]
    if role != "colocated":
        args += ["--kv-key-file", str(key), "--kv-port", "0"]
    process = subprocess.Popen(args, stdout=open(logs / f"{role}.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"{role} server did not become ready")


async def first_token_seconds(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    """Seconds from sending a streaming request to the first chunk carrying a token."""
    started = time.perf_counter()
    async with client.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True}
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("token_ids"):
                return time.perf_counter() - started
    raise RuntimeError("stream ended without a token")


async def prefill(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(url + "/v1/completions", json=prefill_body(body))
    response.raise_for_status()
    return dict(response.json()["kv_transfer_params"])


async def pd_ttft(client: httpx.AsyncClient, prefill_url: str, decode_url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    params = await prefill(client, prefill_url, body)
    after_prefill = time.perf_counter() - started
    return after_prefill + await first_token_seconds(client, decode_url, {**body, "kv_transfer_params": params})


async def measure_ttft(
    urls: dict[str, str], lengths: list[int], repeats: int, rng: np.random.Generator, vocab: int
) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(timeout=3600) as client:
        for length in lengths:
            colocated, disaggregated = [], []
            for _ in range(repeats):
                body = {"prompt": rng.integers(3, vocab, size=length).tolist(), "max_tokens": 4, "temperature": 0}
                colocated.append(await first_token_seconds(client, urls["colocated"], body))
                disaggregated.append(await pd_ttft(client, urls["prefill"], urls["decode"], body))
            row = {
                "prompt_tokens": length,
                "colocated_ttft_s": statistics.median(colocated),
                "pd_ttft_s": statistics.median(disaggregated),
            }
            row["pd_over_colocated"] = row["pd_ttft_s"] / row["colocated_ttft_s"]
            rows.append(row)
            print(
                f"TTFT {length:>5} tokens: colocated {row['colocated_ttft_s']:.3f} s, PD {row['pd_ttft_s']:.3f} s, "
                f"ratio {row['pd_over_colocated']:.2f}",
                flush=True,
            )
    return rows


async def decode_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> int:
    tokens = 0
    async with client.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True}
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                tokens += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
    return tokens


async def decode_round(
    client: httpx.AsyncClient, urls: dict[str, str], clients: int, rng: np.random.Generator, vocab: int
) -> tuple[int, float]:
    """One measurement: `clients` requests prefilled remotely, then decoded concurrently; (tokens, decode seconds)."""
    bodies = [
        {
            "prompt": rng.integers(3, vocab, size=DECODE_PROMPT_TOKENS).tolist(),
            "temperature": 0,
            "max_tokens": DECODE_NEW_TOKENS,
            "ignore_eos": True,
        }
        for _ in range(clients)
    ]
    params = await asyncio.gather(*(prefill(client, urls["prefill"], b) for b in bodies))
    started = time.perf_counter()
    counts = await asyncio.gather(
        *(
            decode_stream(client, urls["decode"], {**b, "kv_transfer_params": p})
            for b, p in zip(bodies, params, strict=True)
        )
    )
    return sum(counts), time.perf_counter() - started


async def measure_decode(
    urls: dict[str, str], rounds: int, rng: np.random.Generator, vocab: int
) -> list[dict[str, Any]]:
    """Rounds interleave the concurrency levels, so a change in the machine's load hits every level alike."""
    samples: dict[int, list[float]] = {clients: [] for clients in CONCURRENCY}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for _ in range(rounds):
            for clients in CONCURRENCY:
                tokens, seconds = await decode_round(client, urls, clients, rng, vocab)
                assert tokens == clients * DECODE_NEW_TOKENS
                samples[clients].append(tokens / seconds)
    rows = [
        {
            "concurrent_requests": clients,
            "tokens_per_second": statistics.median(rates),
            "tokens_per_second_all_rounds": rates,
        }
        for clients, rates in samples.items()
    ]
    for row in rows:
        row["ratio_to_1"] = row["tokens_per_second"] / rows[0]["tokens_per_second"]
        print(
            f"decode {row['concurrent_requests']:>2} clients: {row['tokens_per_second']:8.1f} tokens/s, "
            f"x{row['ratio_to_1']:.2f} of 1 client",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure (the median is reported)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(PROMPT_LENGTHS), help="prompt lengths for TTFT")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ttft_pd_vs_colocated.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as scratch:
        work = Path(scratch)
        model = make_test_checkpoint("dense", work / "model", overrides=BENCH_MODEL)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        key = work / "kv.key"
        key.write_text(secrets.token_hex(32))
        servers = {role: start_server(role, model, key, work) for role in ("colocated", "prefill", "decode")}
        urls = {role: url for role, (_, url) in servers.items()}
        try:
            ttft = asyncio.run(measure_ttft(urls, args.lengths, args.repeats, rng, vocab))
            decode = asyncio.run(measure_decode(urls, args.repeats, rng, vocab))
        finally:
            for process, _ in servers.values():
                process.send_signal(signal.SIGTERM)
                process.wait(30)
    result = {
        "benchmark": "pdserve TTFT PD vs colocated; decode tokens/s vs concurrency",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "model": {"kind": "dense (llama, GQA)", **BENCH_MODEL},
        "link": "loopback (KV channel over 127.0.0.1, 4 streams, HMAC auth, no TLS)",
        "ttft": ttft,
        "decode_throughput": {"prompt_tokens": DECODE_PROMPT_TOKENS, "new_tokens": DECODE_NEW_TOKENS, "rows": decode},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
