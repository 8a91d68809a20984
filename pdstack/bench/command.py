"""`pdstack bench` end to end: check the endpoint, find the peak if asked, run each load, report."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdstack.bench.client import RequestResult
from pdstack.bench.endpoint import APIS, Endpoint, fetch_models, normalise_base_url, pick_model, read_api_key
from pdstack.bench.peak import Peak, ProbeStep, measure_peak
from pdstack.bench.promhist import Histogram, check_run, scrape
from pdstack.bench.report import BenchReport, RunRecord
from pdstack.bench.runner import LagMonitor, LoadSettings, run_open_loop, warm_up
from pdstack.bench.schedule import poisson_arrivals
from pdstack.bench.stats import SLO, Distribution, summarize
from pdstack.bench.workload import make_prompts

PROBE_PROMPTS = 512


class BenchError(ValueError):
    """A setting of the bench is wrong; the message names it."""


@dataclass(frozen=True)
class BenchOptions:
    url: str
    model: str | None
    api: str
    api_key_file: Path | None
    workload: str
    max_tokens: int
    ignore_eos: bool
    rates: tuple[float, ...]
    peak_shares: tuple[float, ...]
    requests: int
    max_duration_s: float
    seed: int
    max_in_flight: int
    timeout_s: float
    slo: SLO
    probe_seconds: float
    probe_max_concurrency: int
    warmup: int
    metrics_url: str | None
    ttft_metric: str | None
    e2e_metric: str | None
    metrics_token_file: Path | None = None  # the token metrics_url requires (the gateway's metrics token)

    def check(self) -> None:
        problems = []
        if self.api not in APIS:
            problems.append(f"api: expected one of {', '.join(APIS)}, got {self.api!r}")
        if self.rates and self.peak_shares:
            problems.append("rate/peak-shares: give fixed rates or shares of the peak, not both")
        if not self.rates and not self.peak_shares:
            problems.append("rate/peak-shares: give --rate or --peak-shares")
        problems += [f"rate: must be positive, got {r:g}" for r in self.rates if not r > 0]
        problems += [f"peak-shares: {s:g} is not within (0, 100] percent" for s in self.peak_shares if not 0 < s <= 100]
        counts = (
            ("requests", self.requests),
            ("max-tokens", self.max_tokens),
            ("max-in-flight", self.max_in_flight),
            ("probe-max-concurrency", self.probe_max_concurrency),
        )
        for name, value in counts:
            if value < 1:
                problems.append(f"{name}: must be at least 1, got {value}")
        for name, seconds in (
            ("max-duration", self.max_duration_s),
            ("timeout", self.timeout_s),
            ("probe-seconds", self.probe_seconds),
            ("slo-ttft-ms", self.slo.ttft_s),
            ("slo-tpot-ms", self.slo.tpot_s),
        ):
            if not seconds > 0:
                problems.append(f"{name}: must be positive, got {seconds:g}")
        if self.warmup < 0:
            problems.append(f"warmup: must be 0 or more, got {self.warmup}")
        if self.metrics_token_file is not None and self.metrics_url is None:
            problems.append("metrics-token-file: is the token of --metrics-url; give that too")
        if problems:
            raise BenchError("; ".join(problems))


def connect(options: BenchOptions) -> tuple[Endpoint, dict[str, object]]:
    base_url = normalise_base_url(options.url)
    api_key = read_api_key(options.api_key_file)
    models = fetch_models(base_url, api_key)
    return Endpoint(base_url, options.api, pick_model(models, options.model), api_key), models


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _scrape(options: BenchOptions, url: str) -> dict[str, Histogram]:
    return scrape(url, token=read_api_key(options.metrics_token_file, "metrics-token-file"))


def _server_snapshot(options: BenchOptions) -> dict[str, Histogram] | None:
    return _scrape(options, options.metrics_url) if options.metrics_url else None


def _server_checks(options: BenchOptions, before: dict[str, Histogram] | None, run: RunRecord) -> None:
    """Set the run's percentiles beside the server's histogram buckets for the same requests."""
    if before is None or options.metrics_url is None:
        return
    # one engine step (median TPOT) plus how late the client's own loop ran (p99 lag)
    step_s = run.summary.tpot.p[50] if run.summary.tpot.count else 0.0
    step_s += run.client_lag.p[99] if run.client_lag.count else 0.0
    run.server_checks, notes = check_run(
        _scrape(options, options.metrics_url), before, run.results, (options.ttft_metric, options.e2e_metric), step_s
    )
    run.server_note = "; ".join(notes) or None


def run_once(
    *, options: BenchOptions, endpoint: Endpoint, settings: LoadSettings, label: str, rate: float, console: Console
) -> RunRecord:
    arrivals = poisson_arrivals(rate, options.requests, options.seed, options.max_duration_s)
    prompts = make_prompts(options.workload, len(arrivals), options.seed)
    before = _server_snapshot(options)
    with _progress(console) as progress:
        task = progress.add_task(f"{label} ({rate:.2f} req/s)", total=len(arrivals))

        def advance(_: RequestResult) -> None:
            progress.advance(task)

        lag = LagMonitor()
        results = asyncio.run(run_open_loop(endpoint, prompts, arrivals, settings, on_done=advance, lag=lag))
    record = RunRecord(label, summarize(results, options.slo, rate), results, Distribution.of(lag.lags))
    _server_checks(options, before, record)
    return record


def planned_rates(options: BenchOptions, peak: Peak | None) -> list[tuple[str, float]]:
    if peak is None:
        return [(f"{rate:g} req/s", rate) for rate in options.rates]
    return [(f"{share:g} % of peak", peak.rate_rps * share / 100) for share in options.peak_shares]


def run_bench(options: BenchOptions, argv: Sequence[str], console: Console) -> BenchReport:
    options.check()
    read_api_key(options.metrics_token_file, "metrics-token-file")  # a missing or empty file stops the bench first
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    load_at_start = os.getloadavg()[0]
    endpoint, models = connect(options)
    settings = LoadSettings(options.max_tokens, options.ignore_eos, options.timeout_s, options.max_in_flight)
    if options.warmup:
        warm_prompts = make_prompts(options.workload, options.warmup, options.seed + 2)
        warm = asyncio.run(warm_up(endpoint, warm_prompts, settings))
        for failed in (r for r in warm if not r.ok):
            console.print(f"warm-up request failed: {failed.error}: {failed.detail}")
    peak = None
    if options.peak_shares:
        probe_prompts = make_prompts(options.workload, PROBE_PROMPTS, options.seed + 1)

        def show(step: ProbeStep) -> None:
            console.print(
                f"peak probe: concurrency {step.concurrency}: {step.throughput_rps:.2f} req/s, "
                f"{step.errors} errors of {step.requests}"
            )

        peak = measure_peak(
            endpoint,
            probe_prompts,
            settings,
            step_seconds=options.probe_seconds,
            max_concurrency=options.probe_max_concurrency,
            on_step=show,
        )
    runs = [
        run_once(options=options, endpoint=endpoint, settings=settings, label=label, rate=rate, console=console)
        for label, rate in planned_rates(options, peak)
    ]
    return BenchReport(
        command=shlex.join(argv),
        started_at=started_at,
        endpoint={"base_url": endpoint.base_url, "api": endpoint.api, "model": endpoint.model},
        models=dict(models),
        workload={
            "name": options.workload,
            "requests_per_run": options.requests,
            "max_duration_s": options.max_duration_s,
            "max_tokens": options.max_tokens,
            "ignore_eos": options.ignore_eos,
            "seed": options.seed,
            "warmup_requests": options.warmup,
            "max_in_flight": options.max_in_flight,
            "timeout_s": options.timeout_s,
            "arrivals": "poisson",
        },
        peak=peak,
        runs=runs,
        # a shared or busy load-generating host skews every latency; the record says how busy it was
        host={
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": load_at_start,
            "load_average_1m_at_end": os.getloadavg()[0],
        },
    )


def command_line() -> list[str]:
    """The command as the user typed it (program name shortened to `pdstack`)."""
    return ["pdstack", *sys.argv[1:]]
