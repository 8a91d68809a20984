"""KV channel goodput on loopback and over an emulated WAN link, against iperf3 on the same path in the same run.

Loopback first (the channel's own ceiling, issue 14 item 4): a KV server process on 127.0.0.1 and one decode process
pulling with 1, 2, 4 and 8 streams, cold then warm, against iperf3 -P N on loopback. Then the WAN: creates two network
namespaces (prefill, decode) joined by pdstack.local.wan, serves one KV blob from a KV server in the
prefill namespace and pulls it from the decode namespace with 1, 2, 4 and 8 streams; runs iperf3 (prefill -> decode)
with the same stream counts. For each stream count one decode process pulls through one connection pool, as a decode
server does: the first pull is cold (it opens and authenticates its connections, and TCP starts from its initial
window), the `--repeats` after it are warm (they reuse those connections). The warm median is the headline; the cold
pull is reported beside it. Writes bench/results/kv_channel-<date>.json and .md and prints the tables. Needs root,
iperf3 and ip (the loopback part alone, --no-wan, needs only iperf3).

    .venv/bin/python bench/kv_channel.py [--rate-mbit 1000] [--rtt-ms 20] [--mib 256] [--repeats 3]
        [--tcp-congestion cubic] [--gap-seconds 0] [--chunk-bytes 1048576] [--stream-counts 1,2,4,8]
        [--notsent-lowat BYTES]
        [--sysctl NAME=VALUE ...] [--no-loopback] [--no-wan] [--output PATH]

Integrity checks are on in every pull: CRC-32C per frame, a BLAKE3 digest per unit verified against the blob
checksum (see pdserve.kv.protocol and pdserve.kv.blob).

--sysctl sets namespaced sysctls in both namespaces (for instance what roles/kernel_tuning sets on real nodes:
net.ipv4.tcp_slow_start_after_idle=0, larger tcp_rmem/tcp_wmem maxima); by default the namespaces keep the kernel's
defaults, as in earlier runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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
from pdserve.kv.arrays import kv_arrays
from pdserve.kv.store import DEFAULT_CHUNK_BYTES
from pdstack.local.wan import TUN_MTU, LinkProcess, LinkShape, create_namespace, default_endpoints, delete_namespace

RESULTS = Path(__file__).parent / "results"
STREAM_COUNTS = (1, 2, 4, 8)
LAYERS = 32
KV_PORT = 7800
LOOPBACK = "127.0.0.1"
REQUEST_ID = "bench-kv"


def synthetic_layers(mib: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    words = (mib << 20) // (2 * LAYERS) // 2  # 16-bit words per K or V array, like fp16/bf16 KV
    return [
        (rng.integers(0, 2**16, words, dtype=np.uint16), rng.integers(0, 2**16, words, dtype=np.uint16))
        for _ in range(LAYERS)
    ]


async def serve(  # noqa: PLR0917
    key_file: str, host: str, mib: int, tcp_congestion: str | None, chunk_bytes: int, notsent_lowat: int | None = None
) -> None:
    """Run inside the prefill namespace (or on loopback): hold one blob and serve it until killed."""
    options = {} if notsent_lowat is None else {"notsent_lowat_bytes": notsent_lowat}
    store = LeaseStore(capacity_bytes=(mib + 1) << 20, default_lease_s=3600, chunk_bytes=chunk_bytes)
    stored = store.put(REQUEST_ID, synthetic_layers(mib), KVMeta(REQUEST_ID, 4096, "bench"))
    server = KVServer(
        store, SecretKey.from_file(key_file), host=host, port=KV_PORT, tcp_congestion=tcp_congestion, **options
    )
    await server.start()
    print(stored.checksum, flush=True)
    await asyncio.Event().wait()


def _allowed(machine: dict[str, Any]) -> str:
    """Which CPUs the bench, its server and iperf3 ran on (a `taskset -c` run uses fewer than the host has)."""
    allowed = machine.get("cpus_allowed")
    return "CPUs used: unrecorded" if allowed is None else f"run on CPUs {','.join(map(str, allowed))}"


def warm_destination(mib: int) -> None:
    """Fault in one destination mapping of the bench blob's layout and leave it idle for the first pull."""
    arrays = kv_arrays([(array.shape, array.dtype.str) for pair in synthetic_layers(mib) for array in pair])
    for array in arrays:
        array.fill(0)


async def pull_repeatedly(  # noqa: PLR0917
    key_file: str, host: str, checksum: str, streams: int, repeats: int, gap_s: float, mib: int = 0
) -> None:
    """Run inside the decode namespace: pull the blob once cold and `repeats` times warm through one pool, `gap_s`
    apart (requests do not arrive back to back), and print the seconds of each pull and the pool's connections."""
    key = SecretKey.from_file(key_file)
    metrics = KVMetrics(CollectorRegistry())
    pool = KVConnectionPool(metrics=metrics)
    if mib:  # as in a decode server that pulled before: its idle destination mapping is faulted in already
        warm_destination(mib)
    seconds, cpu, nbytes = [], [], 0
    for attempt in range(1 + repeats):
        if attempt:
            await asyncio.sleep(gap_s)
        started, cpu_started = time.perf_counter(), time.process_time()
        blob = await pull(
            host, KV_PORT, REQUEST_ID, checksum, key=key, streams=streams, read_timeout_s=30, metrics=metrics, pool=pool
        )
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
        nbytes = blob.nbytes
        del blob
    await pool.close()
    counts = {
        outcome: int(metrics.connections.labels("receiver", outcome)._value.get())
        for outcome in ("new", "reused", "stale")
    }
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "bytes": nbytes, "connections": counts}), flush=True)


def in_ns(namespace: str | None, argv: list[str]) -> list[str]:
    return argv if namespace is None else ["ip", "netns", "exec", namespace, *argv]


def iperf3_mbit(ns_server: str | None, ns_client: str | None, server_ip: str, streams: int, seconds: int) -> float:
    server = subprocess.Popen(in_ns(ns_server, ["iperf3", "-s", "-1", "-B", server_ip]), stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        argv = ["iperf3", "-c", server_ip, "-R", "-P", str(streams), "-t", str(seconds), "-J"]
        report = json.loads(subprocess.run(in_ns(ns_client, argv), capture_output=True, text=True, check=True).stdout)
        return float(report["end"]["sum_received"]["bits_per_second"]) / 1e6
    finally:
        server.kill()
        server.wait()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kv_pulls(
    ns_client: str | None,
    key_file: str,
    server_ip: str,
    checksum: str,
    *,
    streams: int,
    repeats: int,
    gap_s: float,
    server_pid: int,
    mib: int,
    cold_memory: bool,
) -> dict[str, Any]:
    load = os.getloadavg()[0]
    server_cpu = process_cpu_seconds(server_pid)
    argv = [
        sys.executable,
        __file__,
        "pull",
        "--key-file",
        key_file,
        "--host",
        server_ip,
        "--checksum",
        checksum,
        "--streams",
        str(streams),
        "--repeats",
        str(repeats),
        "--gap-seconds",
        str(gap_s),
        "--mib",
        str(0 if cold_memory else mib),
    ]
    result = json.loads(subprocess.run(in_ns(ns_client, argv), capture_output=True, text=True, check=True).stdout)
    server_cpu = process_cpu_seconds(server_pid) - server_cpu
    cold, *warm = result["seconds"]
    warm_mbit = [result["bytes"] * 8 / s / 1e6 for s in warm]
    gib = result["bytes"] / (1 << 30) * len(result["seconds"])
    return {
        "bytes": result["bytes"],
        "cold_seconds": cold,
        "warm_seconds": warm,
        "cold_mbit": result["bytes"] * 8 / cold / 1e6,
        "warm_mbit_median": statistics.median(warm_mbit),
        "warm_mbit_best": max(warm_mbit),
        "connections": result["connections"],
        # CPU seconds per GiB moved (all pulls of the row): what the channel costs, much less noisy than goodput
        # on a shared machine
        "client_cpu_s_per_gib": sum(result["cpu_seconds"]) / gib,
        "server_cpu_s_per_gib": server_cpu / gib,
        "load_average_1min": load,
    }


def start_server(namespace: str | None, key_file: str, host: str, args: argparse.Namespace) -> tuple[Any, str]:
    """A KV server process holding the bench blob; returns it and the blob's checksum."""
    argv = [
        sys.executable,
        __file__,
        "serve",
        "--key-file",
        key_file,
        "--host",
        host,
        "--mib",
        str(args.mib),
        "--chunk-bytes",
        str(args.chunk_bytes),
    ]
    if args.notsent_lowat is not None:
        argv += ["--notsent-lowat", str(args.notsent_lowat)]
    if args.tcp_congestion:
        argv += ["--tcp-congestion", args.tcp_congestion]
    server = subprocess.Popen(in_ns(namespace, argv), stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    return server, server.stdout.readline().strip()


def run_loopback(args: argparse.Namespace, key_file: str) -> dict[str, Any]:
    """One pull process against one server process on 127.0.0.1, beside iperf3 -P N on 127.0.0.1."""
    rows = []
    server, checksum = start_server(None, key_file, LOOPBACK, args)
    try:
        for streams in args.stream_counts:
            iperf = iperf3_mbit(None, None, LOOPBACK, streams, args.iperf_seconds)
            kv = kv_pulls(
                None,
                key_file,
                LOOPBACK,
                checksum,
                streams=streams,
                repeats=args.repeats,
                gap_s=args.gap_seconds,
                server_pid=server.pid,
                mib=args.mib,
                cold_memory=args.cold_memory,
            )
            rows.append(
                {
                    "streams": streams,
                    "iperf3_mbit": iperf,
                    **kv,
                    "kv_share_of_iperf3": kv["warm_mbit_median"] / iperf,
                    "cold_share_of_iperf3": kv["cold_mbit"] / iperf,
                }
            )
    finally:
        server.kill()
        server.wait()
    return {
        "kv_mib": args.mib,
        "layers": LAYERS,
        "kv_chunk_bytes": args.chunk_bytes,
        "warm_repeats": args.repeats,
        "kv_notsent_lowat": args.notsent_lowat,
        "iperf3_seconds": args.iperf_seconds,
        "rows": rows,
    }


def initial_window_segments(args: argparse.Namespace, spec: LinkShape) -> int:
    """--initcwnd as segments: 'bdp' = the link's bandwidth-delay product in full-sized segments of the TUN's MTU."""
    if args.initcwnd in ("", "0"):
        return 0
    if args.initcwnd != "bdp":
        return int(args.initcwnd)
    bdp = spec.rate_mbit * 1e6 / 8 * spec.rtt_ms / 1e3
    return math.ceil(bdp / (TUN_MTU - 52))  # IPv4 + TCP headers with timestamps


def set_peer_route(namespace: str, peer: str, device: str, segments: int) -> None:
    """A host route to the peer whose new connections start with a `segments` congestion and receive window (what a
    node's route to a peer datacenter would carry)."""
    subprocess.run(
        in_ns(
            namespace,
            [
                "ip",
                "route",
                "replace",
                f"{peer}/32",
                "dev",
                device,
                "initcwnd",
                str(segments),
                "initrwnd",
                str(segments),
            ],
        ),
        check=True,
    )


def set_sysctl(namespace: str, name: str, value: str) -> None:
    subprocess.run(in_ns(namespace, ["sysctl", "-qw", f"{name}={value}"]), check=True)


def run_benchmark(args: argparse.Namespace, key_file: str) -> dict[str, Any]:
    tag = os.getpid()
    ns_prefill, ns_decode = f"bench-prefill-{tag}", f"bench-decode-{tag}"
    prefill, decode = default_endpoints(ns_prefill, ns_decode)
    spec = LinkShape(args.rate_mbit, args.rtt_ms)
    rows = []
    create_namespace(ns_prefill)
    create_namespace(ns_decode)
    server = None
    try:
        for namespace in (ns_prefill, ns_decode):
            for name, value in args.sysctl:
                set_sysctl(namespace, name, value)
        with LinkProcess(prefill, decode, spec):
            initcwnd = initial_window_segments(args, spec)
            if initcwnd:
                for near, far in ((prefill, decode), (decode, prefill)):
                    set_peer_route(near.namespace, str(far.address.ip), near.device, initcwnd)
            server, checksum = start_server(ns_prefill, key_file, str(prefill.address.ip), args)
            for streams in args.stream_counts:
                iperf = iperf3_mbit(ns_prefill, ns_decode, str(prefill.address.ip), streams, args.iperf_seconds)
                kv = kv_pulls(
                    ns_decode,
                    key_file,
                    str(prefill.address.ip),
                    checksum,
                    streams=streams,
                    repeats=args.repeats,
                    gap_s=args.gap_seconds,
                    server_pid=server.pid,
                    mib=args.mib,
                    cold_memory=args.cold_memory,
                )
                rows.append(
                    {
                        "streams": streams,
                        "iperf3_mbit": iperf,
                        **kv,
                        "kv_share_of_link": kv["warm_mbit_median"] / args.rate_mbit,
                        "kv_share_of_iperf3": kv["warm_mbit_median"] / iperf,
                        "cold_share_of_link": kv["cold_mbit"] / args.rate_mbit,
                        "cold_share_of_iperf3": kv["cold_mbit"] / iperf,
                    }
                )
    finally:
        if server is not None:
            server.kill()
            server.wait()
        delete_namespace(ns_prefill)
        delete_namespace(ns_decode)
    return {
        "link": {"rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "queue_bytes": spec.queue_limit_bytes},
        "kv_tcp_congestion": args.tcp_congestion or "system default",
        "kv_mib": args.mib,
        "layers": LAYERS,
        "kv_chunk_bytes": args.chunk_bytes,
        "namespace_sysctls": dict(args.sysctl),
        "warm_repeats": args.repeats,
        "cold_memory": args.cold_memory,
        "route_initcwnd_segments": initial_window_segments(args, spec),
        "gap_seconds": args.gap_seconds,
        "iperf3_seconds": args.iperf_seconds,
        "rows": rows,
    }


def loopback_table(report: dict[str, Any]) -> list[str]:
    lines = [
        f"KV {report['kv_mib']} MiB on loopback (one server process, one pull process), against iperf3 -P N on "
        f"loopback in the same run; warm = median of {report['warm_repeats']} pulls on reused connections",
        "",
        "| streams | iperf3 Gbit/s | warm Gbit/s | warm/iperf3 | cold Gbit/s | cold/iperf3 | "
        "CPU s/GiB client | CPU s/GiB server | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['streams']} | {row['iperf3_mbit'] / 1e3:.1f} | {row['warm_mbit_median'] / 1e3:.2f} | "
            f"{row['kv_share_of_iperf3']:.1%} | {row['cold_mbit'] / 1e3:.2f} | "
            f"{row['cold_share_of_iperf3']:.1%} | {row['client_cpu_s_per_gib']:.2f} | "
            f"{row['server_cpu_s_per_gib']:.2f} | {row['load_average_1min']:.1f} |"
        )
    return lines


def wan_table(report: dict[str, Any]) -> list[str]:
    link = report["link"]
    lines = [
        f"KV {report['kv_mib']} MiB over {link['rate_mbit']:g} Mbit/s, {link['rtt_ms']:g} ms RTT (emulated, "
        f"pdstack.local.wan); warm = median of {report['warm_repeats']} pulls on reused connections, cold = the "
        f"first pull; namespace sysctls: {report['namespace_sysctls'] or 'kernel defaults'}; route "
        f"initcwnd/initrwnd: {report['route_initcwnd_segments'] or 'kernel default'}",
        "",
        "| streams | iperf3 Mbit/s | warm Mbit/s | warm/link | warm/iperf3 | cold Mbit/s | cold/link | "
        "cold/iperf3 | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['streams']} | {row['iperf3_mbit']:.0f} | {row['warm_mbit_median']:.0f} | "
            f"{row['kv_share_of_link']:.1%} | {row['kv_share_of_iperf3']:.1%} | {row['cold_mbit']:.0f} | "
            f"{row['cold_share_of_link']:.1%} | {row['cold_share_of_iperf3']:.1%} | "
            f"{row['load_average_1min']:.1f} |"
        )
    return lines


def write_results(folder: Path, report: dict[str, Any]) -> None:
    stem = folder / f"kv_channel-{time.strftime('%Y-%m-%d-%H%M', time.gmtime())}"
    folder.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    machine, load = report["machine"], report["load_average_1min"]
    lines = [
        f"# KV channel goodput ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        f"`{report['command']}`; {machine['cpus']} CPUs ({_allowed(machine)}), kernel {machine['kernel']}, load "
        f"average {load['before']:.1f} before, {load['after']:.1f} after (other work on the machine lowers the KV "
        "figures more than iperf3's).",
    ]
    if "loopback" in report:
        lines += ["", "## Loopback", "", *loopback_table(report["loopback"])]
    if "wan" in report:
        lines += ["", "## Emulated WAN", "", *wan_table(report["wan"])]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


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
    parser.add_argument("--output", type=Path, default=RESULTS, help="folder for kv_channel-<date>.json and .md")
    parser.add_argument("--no-loopback", dest="loopback", action="store_false", help="skip the loopback part")
    parser.add_argument("--no-wan", dest="wan", action="store_false", help="skip the emulated WAN part")
    parser.add_argument("--key-file")
    parser.add_argument("--host")
    parser.add_argument("--checksum")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tcp-congestion", default=None, help="the KV server's congestion control (default: system)")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="the KV store's DATA frame size")
    parser.add_argument(
        "--notsent-lowat",
        type=int,
        default=None,
        help="the KV server's TCP_NOTSENT_LOWAT in bytes (default: KVServer's own)",
    )
    parser.add_argument(
        "--stream-counts",
        type=lambda text: [int(n) for n in text.split(",")],
        default=STREAM_COUNTS,
        help="comma-separated stream counts (default 1,2,4,8)",
    )
    parser.add_argument(
        "--cold-memory",
        action="store_true",
        help="the cold pull also lands in fresh memory (a new "
        "decode process); by default the pull process faults in one destination mapping first, so "
        "cold means new connections only",
    )
    parser.add_argument("--gap-seconds", type=float, default=0.0, help="pause between one pull and the next")
    parser.add_argument(
        "--initcwnd",
        default="",
        help="WAN: initcwnd/initrwnd of the routes between the namespaces, "
        "in segments, or 'bdp' (the link's BDP in segments); default: the kernel's (10)",
    )
    parser.add_argument(
        "--sysctl",
        type=sysctl_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a namespaced sysctl in both namespaces (repeatable), e.g. what kernel_tuning sets",
    )
    args = parser.parse_args()
    if args.mode == "serve":
        asyncio.run(
            serve(args.key_file, args.host, args.mib, args.tcp_congestion, args.chunk_bytes, args.notsent_lowat)
        )
    elif args.mode == "pull":
        asyncio.run(
            pull_repeatedly(
                args.key_file, args.host, args.checksum, args.streams, args.repeats, args.gap_seconds, args.mib
            )
        )
    else:
        with tempfile.TemporaryDirectory() as folder:
            key_file = Path(folder) / "kv.key"
            key_file.write_text(secrets.token_hex(32))
            key_file.chmod(0o600)
            load_before = os.getloadavg()[0]
            report: dict[str, Any] = {}
            if args.loopback:
                report["loopback"] = run_loopback(args, str(key_file))
            if args.wan:
                report["wan"] = run_benchmark(args, str(key_file))
        # Python moves the KV and the link, so other work on the machine lowers KV goodput more than iperf3's.
        report["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
        report["command"] = shlex.join([Path(sys.executable).name, *sys.argv])
        report["machine"] = {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "cpus_allowed": sorted(os.sched_getaffinity(0)),
            "python": platform.python_version(),
        }
        write_results(args.output, report)


if __name__ == "__main__":
    main()
