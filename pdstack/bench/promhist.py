"""Read latency histograms from a Prometheus /metrics page, to set a run's numbers beside the server's own."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdstack.bench.stats import nearest_rank

_BUCKET = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)_bucket\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)')
_SUM = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)_sum(?:\{[^}]*\})?\s+(?P<value>\S+)')
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


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, Histogram]:
    response = httpx.get(url, timeout=timeout_s)
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

    The client sees each answer a little later than the server records it (HTTP, parsing, loopback); `offset_s`,
    the difference of the two means over the same requests, widens the bucket by that much on both sides.
    """

    metric: str
    q: int
    bench_s: float
    bucket: tuple[float, float]
    offset_s: float

    @property
    def agrees(self) -> bool:
        lower, upper = self.bucket
        return lower - self.offset_s <= self.bench_s <= upper + self.offset_s

    def as_json(self) -> dict[str, Any]:
        lower, upper = self.bucket
        return {
            "metric": self.metric,
            "q": self.q,
            "bench_s": self.bench_s,
            "server_bucket_s": [lower, None if math.isinf(upper) else upper],
            "offset_s": self.offset_s,
            "agrees": self.agrees,
        }


def mean_offset(metric: Histogram, bench_values: Sequence[float]) -> float:
    """|bench mean - server mean| over the same requests (0 when either side has none)."""
    if metric.mean is None or not bench_values:
        return 0.0
    return abs(sum(bench_values) / len(bench_values) - metric.mean)


def compare(metric: Histogram, bench_values: Sequence[float], quantiles: Sequence[int]) -> list[QuantileCheck]:
    offset = mean_offset(metric, bench_values)
    return [
        QuantileCheck(metric.name, q, nearest_rank(bench_values, q), metric.quantile_bucket(q), offset)
        for q in quantiles
    ]
