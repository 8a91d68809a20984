"""KV channel goodput over an emulated WAN link, against the link rate and against iperf3 on the same link.

Creates two network namespaces (prefill, decode) joined by pdstack.wanlink, serves one KV blob from a KV server in the
prefill namespace and pulls it from the decode namespace with 1, 2, 4 and 8 streams; runs iperf3 (prefill -> decode)
with the same stream counts. Writes bench/results/kv_channel.json and prints a table. Needs root, iperf3 and ip.

    .venv/bin/python bench/kv_channel.py [--rate-mbit 1000] [--rtt-ms 20] [--mib 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.kv import KVMeta, KVServer, LeaseStore, SecretKey, pull
from pdstack.wanlink import LinkProcess, LinkSpec, create_namespace, default_endpoints, delete_namespace

RESULTS = Path(__file__).parent / "results" / "kv_channel.json"
STREAM_COUNTS = (1, 2, 4, 8)
LAYERS = 32
KV_PORT = 7800
REQUEST_ID = "bench-kv"


def synthetic_layers(mib: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    words = (mib << 20) // (2 * LAYERS) // 2  # 16-bit words per K or V array, like fp16/bf16 KV
    return [
        (rng.integers(0, 2**16, words, dtype=np.uint16), rng.integers(0, 2**16, words, dtype=np.uint16))
        for _ in range(LAYERS)
    ]


async def serve(key_file: str, host: str, mib: int, tcp_congestion: str | None) -> None:
    """Run inside the prefill namespace: hold one blob and serve it until killed."""
    store = LeaseStore(capacity_bytes=(mib + 1) << 20, default_lease_s=3600)
    stored = store.put(REQUEST_ID, synthetic_layers(mib), KVMeta(REQUEST_ID, 4096, "bench"))
    server = KVServer(store, SecretKey.from_file(key_file), host=host, port=KV_PORT, tcp_congestion=tcp_congestion)
    await server.start()
    print(stored.checksum, flush=True)
    await asyncio.Event().wait()


async def pull_repeatedly(key_file: str, host: str, checksum: str, streams: int, repeats: int) -> None:
    """Run inside the decode namespace: pull the blob `repeats` times and print the seconds of each pull."""
    key = SecretKey.from_file(key_file)
    seconds, nbytes = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        blob = await pull(host, KV_PORT, REQUEST_ID, checksum, key=key, streams=streams, read_timeout_s=30)
        seconds.append(time.perf_counter() - started)
        nbytes = blob.nbytes
        del blob
    print(json.dumps({"seconds": seconds, "bytes": nbytes}), flush=True)


def in_ns(namespace: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def iperf3_mbit(ns_server: str, ns_client: str, server_ip: str, streams: int, seconds: int) -> float:
    server = subprocess.Popen(in_ns(ns_server, ["iperf3", "-s", "-1"]), stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        argv = ["iperf3", "-c", server_ip, "-R", "-P", str(streams), "-t", str(seconds), "-J"]
        report = json.loads(subprocess.run(in_ns(ns_client, argv), capture_output=True, text=True, check=True).stdout)
        return float(report["end"]["sum_received"]["bits_per_second"]) / 1e6
    finally:
        server.kill()
        server.wait()


def kv_pulls(
    ns_client: str, key_file: str, server_ip: str, checksum: str, *, streams: int, repeats: int
) -> dict[str, Any]:
    argv = [sys.executable, __file__, "pull", "--key-file", key_file, "--host", server_ip,
            "--checksum", checksum, "--streams", str(streams), "--repeats", str(repeats)]  # fmt: skip
    result = json.loads(subprocess.run(in_ns(ns_client, argv), capture_output=True, text=True, check=True).stdout)
    mbit = [result["bytes"] * 8 / s / 1e6 for s in result["seconds"]]
    return {"bytes": result["bytes"], "seconds": result["seconds"], "mbit_median": statistics.median(mbit),
            "mbit_best": max(mbit)}  # fmt: skip


def run_benchmark(args: argparse.Namespace, key_file: str) -> dict[str, Any]:
    tag = os.getpid()
    ns_prefill, ns_decode = f"bench-prefill-{tag}", f"bench-decode-{tag}"
    prefill, decode = default_endpoints(ns_prefill, ns_decode)
    spec = LinkSpec(args.rate_mbit, args.rtt_ms)
    rows = []
    create_namespace(ns_prefill)
    create_namespace(ns_decode)
    server = None
    try:
        with LinkProcess(prefill, decode, spec):
            serve_argv = [sys.executable, __file__, "serve", "--key-file", key_file, "--host", str(prefill.address.ip),
                          "--mib", str(args.mib)]  # fmt: skip
            if args.tcp_congestion:
                serve_argv += ["--tcp-congestion", args.tcp_congestion]
            server = subprocess.Popen(in_ns(ns_prefill, serve_argv), stdout=subprocess.PIPE, text=True)
            assert server.stdout is not None
            checksum = server.stdout.readline().strip()
            for streams in STREAM_COUNTS:
                iperf = iperf3_mbit(ns_prefill, ns_decode, str(prefill.address.ip), streams, args.iperf_seconds)
                kv = kv_pulls(
                    ns_decode, key_file, str(prefill.address.ip), checksum, streams=streams, repeats=args.repeats
                )
                rows.append({"streams": streams, "iperf3_mbit": iperf, **kv,
                             "kv_share_of_link": kv["mbit_median"] / args.rate_mbit,
                             "kv_share_of_iperf3": kv["mbit_median"] / iperf})  # fmt: skip
    finally:
        if server is not None:
            server.kill()
            server.wait()
        delete_namespace(ns_prefill)
        delete_namespace(ns_decode)
    return {"link": {"rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "queue_bytes": spec.queue_limit_bytes},
            "kv_tcp_congestion": args.tcp_congestion or "system default",
            "kv_mib": args.mib, "layers": LAYERS, "repeats": args.repeats, "iperf3_seconds": args.iperf_seconds,
            "rows": rows}  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    print(f"KV {report['kv_mib']} MiB over {report['link']['rate_mbit']:g} Mbit/s, {report['link']['rtt_ms']:g} ms RTT")
    print(f"{'streams':>7} {'iperf3 Mbit/s':>14} {'KV Mbit/s (median)':>19} {'KV/link':>8} {'KV/iperf3':>10}")
    for row in report["rows"]:
        print(f"{row['streams']:>7} {row['iperf3_mbit']:>14.0f} {row['mbit_median']:>19.0f} "
              f"{row['kv_share_of_link']:>8.1%} {row['kv_share_of_iperf3']:>10.1%}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "serve", "pull"])
    parser.add_argument("--rate-mbit", type=float, default=1000)
    parser.add_argument("--rtt-ms", type=float, default=20)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iperf-seconds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--key-file")
    parser.add_argument("--host")
    parser.add_argument("--checksum")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tcp-congestion", default=None, help="the KV server's congestion control (default: system)")
    args = parser.parse_args()
    if args.mode == "serve":
        asyncio.run(serve(args.key_file, args.host, args.mib, args.tcp_congestion))
    elif args.mode == "pull":
        asyncio.run(pull_repeatedly(args.key_file, args.host, args.checksum, args.streams, args.repeats))
    else:
        with tempfile.TemporaryDirectory() as folder:
            key_file = Path(folder) / "kv.key"
            key_file.write_text(secrets.token_hex(32))
            key_file.chmod(0o600)
            load_before = os.getloadavg()[0]
            report = run_benchmark(args, str(key_file))
        # Python moves the KV and the link, so other work on the machine lowers KV goodput more than iperf3's.
        report["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
        report["command"] = shlex.join([Path(sys.executable).name, *sys.argv])
        report["machine"] = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print_table(report)


if __name__ == "__main__":
    main()
