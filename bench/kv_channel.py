"""KV channel goodput over an emulated WAN link, against the link rate and against iperf3 on the same link.

Creates two network namespaces (prefill, decode) joined by pdstack.wanlink, serves one KV blob from a KV server in the
prefill namespace and pulls it from the decode namespace with 1, 2, 4 and 8 streams; runs iperf3 (prefill -> decode)
with the same stream counts. For each stream count one decode process pulls through one connection pool, as a decode
server does: the first pull is cold (it opens and authenticates its connections, and TCP starts from its initial
window), the `--repeats` after it are warm (they reuse those connections). The warm median is the headline; the cold
pull is reported beside it. Writes bench/results/kv_channel.json and prints a table. Needs root, iperf3 and ip.

    .venv/bin/python bench/kv_channel.py [--rate-mbit 1000] [--rtt-ms 20] [--mib 256] [--repeats 3]
        [--tcp-congestion cubic] [--gap-seconds 0] [--chunk-bytes 1048576] [--stream-counts 1,2,4,8]
        [--sysctl NAME=VALUE ...] [--output PATH]

--sysctl sets namespaced sysctls in both namespaces (for instance what roles/kernel_tuning sets on real nodes:
net.ipv4.tcp_slow_start_after_idle=0, larger tcp_rmem/tcp_wmem maxima); by default the namespaces keep the kernel's
defaults, as in earlier runs.
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
from prometheus_client import CollectorRegistry

from pdserve.kv import KVConnectionPool, KVMeta, KVMetrics, KVServer, LeaseStore, SecretKey, pull
from pdserve.kv.store import DEFAULT_CHUNK_BYTES
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


async def serve(key_file: str, host: str, mib: int, tcp_congestion: str | None, chunk_bytes: int) -> None:
    """Run inside the prefill namespace: hold one blob and serve it until killed."""
    store = LeaseStore(capacity_bytes=(mib + 1) << 20, default_lease_s=3600, chunk_bytes=chunk_bytes)
    stored = store.put(REQUEST_ID, synthetic_layers(mib), KVMeta(REQUEST_ID, 4096, "bench"))
    server = KVServer(store, SecretKey.from_file(key_file), host=host, port=KV_PORT, tcp_congestion=tcp_congestion)
    await server.start()
    print(stored.checksum, flush=True)
    await asyncio.Event().wait()


async def pull_repeatedly(  # noqa: PLR0917
    key_file: str, host: str, checksum: str, streams: int, repeats: int, gap_s: float
) -> None:
    """Run inside the decode namespace: pull the blob once cold and `repeats` times warm through one pool, `gap_s`
    apart (requests do not arrive back to back), and print the seconds of each pull and the pool's connections."""
    key = SecretKey.from_file(key_file)
    metrics = KVMetrics(CollectorRegistry())
    pool = KVConnectionPool(metrics=metrics)
    seconds, nbytes = [], 0
    for attempt in range(1 + repeats):
        if attempt:
            await asyncio.sleep(gap_s)
        started = time.perf_counter()
        blob = await pull(host, KV_PORT, REQUEST_ID, checksum, key=key, streams=streams, read_timeout_s=30,
                          metrics=metrics, pool=pool)  # fmt: skip
        seconds.append(time.perf_counter() - started)
        nbytes = blob.nbytes
        del blob
    await pool.close()
    counts = {outcome: int(metrics.connections.labels("receiver", outcome)._value.get())
              for outcome in ("new", "reused", "stale")}  # fmt: skip
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "connections": counts}), flush=True)


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
    ns_client: str, key_file: str, server_ip: str, checksum: str, *, streams: int, repeats: int, gap_s: float
) -> dict[str, Any]:
    argv = [sys.executable, __file__, "pull", "--key-file", key_file, "--host", server_ip, "--checksum", checksum,
            "--streams", str(streams), "--repeats", str(repeats), "--gap-seconds", str(gap_s)]  # fmt: skip
    result = json.loads(subprocess.run(in_ns(ns_client, argv), capture_output=True, text=True, check=True).stdout)
    cold, *warm = result["seconds"]
    warm_mbit = [result["bytes"] * 8 / s / 1e6 for s in warm]
    return {"bytes": result["bytes"], "cold_seconds": cold, "warm_seconds": warm,
            "cold_mbit": result["bytes"] * 8 / cold / 1e6, "warm_mbit_median": statistics.median(warm_mbit),
            "warm_mbit_best": max(warm_mbit), "connections": result["connections"]}  # fmt: skip


def set_sysctl(namespace: str, name: str, value: str) -> None:
    subprocess.run(in_ns(namespace, ["sysctl", "-qw", f"{name}={value}"]), check=True)


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
        for namespace in (ns_prefill, ns_decode):
            for name, value in args.sysctl:
                set_sysctl(namespace, name, value)
        with LinkProcess(prefill, decode, spec):
            serve_argv = [sys.executable, __file__, "serve", "--key-file", key_file, "--host", str(prefill.address.ip),
                          "--mib", str(args.mib), "--chunk-bytes", str(args.chunk_bytes)]  # fmt: skip
            if args.tcp_congestion:
                serve_argv += ["--tcp-congestion", args.tcp_congestion]
            server = subprocess.Popen(in_ns(ns_prefill, serve_argv), stdout=subprocess.PIPE, text=True)
            assert server.stdout is not None
            checksum = server.stdout.readline().strip()
            for streams in args.stream_counts:
                iperf = iperf3_mbit(ns_prefill, ns_decode, str(prefill.address.ip), streams, args.iperf_seconds)
                kv = kv_pulls(ns_decode, key_file, str(prefill.address.ip), checksum, streams=streams,
                              repeats=args.repeats, gap_s=args.gap_seconds)  # fmt: skip
                rows.append({"streams": streams, "iperf3_mbit": iperf, **kv,
                             "kv_share_of_link": kv["warm_mbit_median"] / args.rate_mbit,
                             "kv_share_of_iperf3": kv["warm_mbit_median"] / iperf,
                             "cold_share_of_link": kv["cold_mbit"] / args.rate_mbit,
                             "cold_share_of_iperf3": kv["cold_mbit"] / iperf})  # fmt: skip
    finally:
        if server is not None:
            server.kill()
            server.wait()
        delete_namespace(ns_prefill)
        delete_namespace(ns_decode)
    return {"link": {"rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "queue_bytes": spec.queue_limit_bytes},
            "kv_tcp_congestion": args.tcp_congestion or "system default",
            "kv_mib": args.mib, "layers": LAYERS, "kv_chunk_bytes": args.chunk_bytes,
            "namespace_sysctls": dict(args.sysctl), "warm_repeats": args.repeats,
            "gap_seconds": args.gap_seconds,
            "iperf3_seconds": args.iperf_seconds, "rows": rows}  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    link = report["link"]
    print(f"KV {report['kv_mib']} MiB over {link['rate_mbit']:g} Mbit/s, {link['rtt_ms']:g} ms RTT; warm = median of "
          f"{report['warm_repeats']} pulls on reused connections, cold = the first pull")  # fmt: skip
    print(f"{'streams':>7} {'iperf3 Mbit/s':>14} {'warm Mbit/s':>12} {'warm/link':>10} {'warm/iperf3':>12} "
          f"{'cold Mbit/s':>12} {'cold/link':>10} {'cold/iperf3':>12}")  # fmt: skip
    for row in report["rows"]:
        print(f"{row['streams']:>7} {row['iperf3_mbit']:>14.0f} {row['warm_mbit_median']:>12.0f} "
              f"{row['kv_share_of_link']:>10.1%} {row['kv_share_of_iperf3']:>12.1%} {row['cold_mbit']:>12.0f} "
              f"{row['cold_share_of_link']:>10.1%} {row['cold_share_of_iperf3']:>12.1%}")  # fmt: skip
    load = report["load_average_1min"]
    print(f"load average (1 min) before {load['before']:.2f}, after {load['after']:.2f}")


def sysctl_setting(text: str) -> tuple[str, str]:
    name, _, value = text.partition("=")
    if not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


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
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="the KV store's DATA frame size")
    parser.add_argument("--stream-counts", type=lambda text: [int(n) for n in text.split(",")], default=STREAM_COUNTS,
                        help="comma-separated stream counts (default 1,2,4,8)")
    parser.add_argument("--gap-seconds", type=float, default=0.0, help="pause between one pull and the next")
    parser.add_argument("--sysctl", type=sysctl_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="set a namespaced sysctl in both namespaces (repeatable), e.g. what kernel_tuning sets")
    args = parser.parse_args()
    if args.mode == "serve":
        asyncio.run(serve(args.key_file, args.host, args.mib, args.tcp_congestion, args.chunk_bytes))
    elif args.mode == "pull":
        asyncio.run(pull_repeatedly(args.key_file, args.host, args.checksum, args.streams, args.repeats,
                                    args.gap_seconds))
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
