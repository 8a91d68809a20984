"""Read latency histograms from a Prometheus /metrics page, to set a run's numbers beside the server's own."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdstack.bench.client import RequestResult
from pdstack.bench.endpoint import EndpointError
from pdstack.bench.stats import QUANTILES, nearest_rank

_BUCKET = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)")
_SUM = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)_sum(?:\{[^}]*\})?\s+(?P<value>\S+)")
_LE = re.compile(r'le="(?P<le>[^"]+)"')

# name fragments that identify the two latencies in common servers (pdserve, vLLM, Dynamo, SGLang)
TTFT_HINTS = ("time_to_first_token", "ttft")
E2E_HINTS = ("e2e", "request_latency", "request_duration", "end_to_end")


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound, summed over every label set except `le`."""

    name: str
    buckets: tuple[tuple[float, float], ...]
    total: float = 0.0  # the _sum series: the observations' sum

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def minus(self, before: Histogram | None) -> Histogram:
        """The observations made since `before` was scraped."""
        if before is None:
            return self
        earlier = dict(before.buckets)
        buckets = tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets)
        return Histogram(self.name, buckets, self.total - before.total)

    def quantile_bucket(self, q: float) -> tuple[float, float]:
        """(lower, upper] bounds of the bucket holding the q-th percentile observation."""
        if self.count <= 0:
            raise ValueError(f"{self.name}: no observations")
        rank = math.ceil(q / 100 * self.count)
        lower = 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                return lower, le
            lower = le
        return lower, math.inf


def parse_histograms(text: str) -> dict[str, Histogram]:
    """Every histogram on a Prometheus text-format page."""
    sums: dict[str, dict[float, float]] = {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        total = _SUM.match(line)
        if total:
            totals[total["name"]] = totals.get(total["name"], 0.0) + float(total["value"])
            continue
        match = _BUCKET.match(line)
        if not match:
            continue
        le = _LE.search(match["labels"])
        if not le:
            continue
        bound = math.inf if le["le"] in ("+Inf", "Inf") else float(le["le"])
        per_bound = sums.setdefault(match["name"], {})
        per_bound[bound] = per_bound.get(bound, 0.0) + float(match["value"])
    return {name: Histogram(name, tuple(sorted(b.items())), totals.get(name, 0.0)) for name, b in sums.items()}


def scrape(url: str, timeout_s: float = 10.0, token: str | None = None) -> dict[str, Histogram]:
    """The histograms of a /metrics page, presenting `token` as a Bearer token when given (the gateway's /metrics
    requires its metrics token)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(url, timeout=timeout_s, headers=headers)
    if response.status_code == httpx.codes.UNAUTHORIZED:
        raise EndpointError(
            f"metrics-url: {url} answered 401: give the token it requires with --metrics-token-file"
            + (" (this one was refused)" if token else "")
        )
    response.raise_for_status()
    return parse_histograms(response.text)


def find_histogram(histograms: dict[str, Histogram], wanted: str | None, hints: Sequence[str]) -> str | None:
    """The named histogram, or the first whose name carries one of `hints`."""
    if wanted is not None:
        return wanted if wanted in histograms else None
    for name in sorted(histograms):
        if any(hint in name for hint in hints):
            return name
    return None


@dataclass(frozen=True)
class QuantileCheck:
    """One percentile as the run measured it (nearest rank) and the server's histogram bucket holding it.

    The client sees each event after the server records it: loopback transport, plus up to one engine step when the
    server's event loop is busy stepping. `allowance_s` (the run's median TPOT plus a few milliseconds) widens the
    bucket's upper bound by that much. The lower bound is strict: a client cannot see a token before it exists.
    """

    metric: str
    measure: str  # what the bench compared: "ttft", "first_event" or "e2e"
    q: int
    bench_s: float
    bucket: tuple[float, float]
    allowance_s: float
    mean_offset_s: float | None

    @property
    def agrees(self) -> bool:
        lower, upper = self.bucket
        return lower <= self.bench_s <= upper + self.allowance_s

    def as_json(self) -> dict[str, Any]:
        lower, upper = self.bucket
        return {
            "metric": self.metric,
            "measure": self.measure,
            "q": self.q,
            "bench_s": self.bench_s,
            "server_bucket_s": [lower, None if math.isinf(upper) else upper],
            "allowance_s": self.allowance_s,
            "mean_offset_s": self.mean_offset_s,
            "agrees": self.agrees,
        }


def mean_offset(metric: Histogram, bench_values: Sequence[float]) -> float | None:
    """Bench mean minus server mean over the same requests (None when either side has none)."""
    if metric.mean is None or not bench_values:
        return None
    return sum(bench_values) / len(bench_values) - metric.mean


def compare(
    metric: Histogram, measure: str, bench_values: Sequence[float], quantiles: Sequence[int], allowance_s: float
) -> list[QuantileCheck]:
    offset = mean_offset(metric, bench_values)
    return [
        QuantileCheck(
            metric.name, measure, q, nearest_rank(bench_values, q), metric.quantile_bucket(q), allowance_s, offset
        )
        for q in quantiles
    ]


TRANSPORT_ALLOWANCE_S = 0.005  # loopback or LAN: HTTP framing and parsing on both ends


def check_run(
    after: dict[str, Histogram],
    before: dict[str, Histogram],
    results: Sequence[RequestResult],
    names: tuple[str | None, str | None],
    step_s: float,
) -> tuple[list[QuantileCheck], list[str]]:
    """The run's TTFT, first-event and e2e percentiles beside the server histograms' change over the run.

    `names` are the TTFT and e2e histogram names (None: found by name); `step_s` is one engine step as the client saw
    it (the run's median TPOT). Returns the checks and notes on what could not be compared.
    """
    ok = [r for r in results if r.ok]
    ttft_name, e2e_name = names
    wanted = (
        (
            ttft_name,
            TTFT_HINTS,
            {
                "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
                "first_event": [r.first_event_s for r in ok if r.first_event_s is not None],
            },
        ),
        (e2e_name, E2E_HINTS, {"e2e": [r.e2e_s for r in ok if r.e2e_s is not None]}),
    )
    checks: list[QuantileCheck] = []
    notes: list[str] = []
    for name, hints, measures in wanted:
        found = find_histogram(after, name, hints)
        if found is None:
            notes.append(f"no histogram {name or 'matching ' + '/'.join(hints)} on the server's metrics page")
            continue
        delta = after[found].minus(before.get(found))
        if delta.count != len(ok):
            notes.append(f"{found} counted {delta.count:g} requests during the run, the bench had {len(ok)} answered")
        if delta.count <= 0:
            continue
        for measure, values in measures.items():
            if values:
                checks += compare(delta, measure, values, QUANTILES, step_s + TRANSPORT_ALLOWANCE_S)
    return checks, notes
