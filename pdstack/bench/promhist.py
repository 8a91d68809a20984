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
_LE = re.compile(r'le="(?P<le>[^"]+)"')

# name fragments that identify the two latencies in common servers (pdserve, vLLM, Dynamo, SGLang)
TTFT_HINTS = ("time_to_first_token", "ttft")
E2E_HINTS = ("e2e", "request_latency", "request_duration", "end_to_end")


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound, summed over every label set except `le`."""

    name: str
    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, before: Histogram | None) -> Histogram:
        """The observations made since `before` was scraped."""
        if before is None:
            return self
        earlier = dict(before.buckets)
        return Histogram(self.name, tuple((le, n - earlier.get(le, 0.0)) for le, n in self.buckets))

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
    for line in text.splitlines():
        match = _BUCKET.match(line)
        if not match:
            continue
        le = _LE.search(match["labels"])
        if not le:
            continue
        bound = math.inf if le["le"] in ("+Inf", "Inf") else float(le["le"])
        per_bound = sums.setdefault(match["name"], {})
        per_bound[bound] = per_bound.get(bound, 0.0) + float(match["value"])
    return {name: Histogram(name, tuple(sorted(b.items()))) for name, b in sums.items()}


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
    """One percentile as the run measured it (nearest rank) and the server's histogram bucket holding it."""

    metric: str
    q: int
    bench_s: float
    bucket: tuple[float, float]

    @property
    def agrees(self) -> bool:
        lower, upper = self.bucket
        return lower <= self.bench_s <= upper

    def as_json(self) -> dict[str, Any]:
        lower, upper = self.bucket
        return {
            "metric": self.metric,
            "q": self.q,
            "bench_s": self.bench_s,
            "server_bucket_s": [lower, None if math.isinf(upper) else upper],
            "agrees": self.agrees,
        }


def compare(metric: Histogram, bench_values: Sequence[float], quantiles: Sequence[int]) -> list[QuantileCheck]:
    return [
        QuantileCheck(metric.name, q, nearest_rank(bench_values, q), metric.quantile_bucket(q)) for q in quantiles
    ]
