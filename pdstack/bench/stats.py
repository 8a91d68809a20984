"""Percentiles, throughput and goodput of a finished run."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdstack.bench.client import ERROR_CAUSES, RequestResult

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The smallest value with at least q % of the values at or below it (how histogram buckets rank)."""
    if not values:
        raise ValueError("nearest_rank of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class SLO:
    """Service-level objectives a request must meet to count towards goodput."""

    ttft_s: float
    tpot_s: float

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok or result.ttft_s is None:
            return False
        tpot = result.tpot_s
        return result.ttft_s <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in seconds."""

    count: int
    mean: float | None
    p: dict[int, float] = field(default_factory=dict)

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(count=0, mean=None)
        return cls(count=len(values), mean=sum(values) / len(values), p={q: percentile(values, q) for q in QUANTILES})

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, **{f"p{q}": v for q, v in self.p.items()}}


@dataclass(frozen=True)
class Summary:
    """What one run measured. Rates are per second of `duration_s`, from the run's start to its last answer."""

    offered_rate: float | None
    requests: int
    completed: int
    errors: dict[str, int]
    duration_s: float
    throughput_rps: float
    ttft: Distribution
    tpot: Distribution
    e2e: Distribution
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    slo: SLO
    good: int
    goodput_rps: float
    max_lateness_s: float

    @property
    def slo_attainment(self) -> float:
        return self.good / self.requests if self.requests else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "offered_rate": self.offered_rate,
            "requests": self.requests,
            "completed": self.completed,
            "failed": self.requests - self.completed,
            "errors": self.errors,
            "duration_s": self.duration_s,
            "throughput_rps": self.throughput_rps,
            "ttft_s": self.ttft.as_json(),
            "tpot_s": self.tpot.as_json(),
            "e2e_s": self.e2e.as_json(),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
            "good_requests": self.good,
            "goodput_rps": self.goodput_rps,
            "slo_attainment": self.slo_attainment,
            "max_arrival_lateness_s": self.max_lateness_s,
        }


def errors_by_cause(results: Sequence[RequestResult]) -> dict[str, int]:
    counts = Counter(r.error for r in results if r.error is not None)
    return {cause: counts[cause] for cause in ERROR_CAUSES if counts[cause]}


def run_duration(results: Sequence[RequestResult]) -> float:
    """From the run's start to the last answer (or the last launch, when nothing answered)."""
    ends = [r.start_s + (r.e2e_s or 0.0) for r in results]
    return max(ends, default=0.0)


def summarize(results: Sequence[RequestResult], slo: SLO, offered_rate: float | None) -> Summary:
    ok = [r for r in results if r.ok]
    duration = run_duration(results)

    def per_s(amount: float) -> float:
        return amount / duration if duration > 0 else 0.0

    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(1 for r in results if slo.met_by(r))
    return Summary(
        offered_rate=offered_rate,
        requests=len(results),
        completed=len(ok),
        errors=errors_by_cause(results),
        duration_s=duration,
        throughput_rps=per_s(len(ok)),
        ttft=Distribution.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Distribution.of([t for r in ok if (t := r.tpot_s) is not None]),
        e2e=Distribution.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        output_tokens_per_s=per_s(output_tokens),
        total_tokens_per_s=per_s(prompt_tokens + output_tokens),
        slo=slo,
        good=good,
        goodput_rps=per_s(good),
        max_lateness_s=max((r.start_s - r.scheduled_s for r in results), default=0.0),
    )
