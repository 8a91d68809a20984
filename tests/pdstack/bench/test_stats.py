"""Percentiles, TPOT, goodput and run summaries on inputs whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from pdstack.bench.client import HTTP_5XX, OVERLOAD, TIMEOUT, RequestResult
from pdstack.bench.stats import SLO, nearest_rank, percentile, summarize


def ok(index: int, start: float, *, ttft: float, e2e: float, tokens: int, prompt_tokens: int = 10) -> RequestResult:
    return RequestResult(
        index,
        scheduled_s=start,
        start_s=start,
        prompt_kind="short",
        ttft_s=ttft,
        e2e_s=e2e,
        prompt_tokens=prompt_tokens,
        completion_tokens=tokens,
        content_chunks=tokens,
    )


def failed(index: int, start: float, cause: str) -> RequestResult:
    return RequestResult(index, scheduled_s=start, start_s=start, prompt_kind="short", error=cause)


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    rng = np.random.default_rng(3)
    sample = list(rng.lognormal(size=257))
    for q in (50, 90, 99):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))


def test_nearest_rank_is_the_value_a_histogram_bucket_would_hold() -> None:
    values = [float(v) for v in range(1, 101)]
    assert nearest_rank(values, 50) == 50.0
    assert nearest_rank(values, 99) == 99.0
    assert nearest_rank([7.0], 99) == 7.0


def test_percentile_refuses_no_values_and_bad_q() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_tpot_spreads_decode_time_over_tokens_after_the_first() -> None:
    assert ok(0, 0.0, ttft=0.2, e2e=1.2, tokens=11).tpot_s == pytest.approx(0.1)
    assert ok(0, 0.0, ttft=0.2, e2e=0.2, tokens=1).tpot_s is None
    no_usage = RequestResult(0, 0.0, 0.0, "short", ttft_s=0.1, e2e_s=0.5, content_chunks=5)
    assert no_usage.tpot_s == pytest.approx(0.1)


def test_slo_requires_both_objectives_and_success() -> None:
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    assert slo.met_by(ok(0, 0.0, ttft=0.5, e2e=0.5 + 9 * 0.05, tokens=10))
    assert not slo.met_by(ok(0, 0.0, ttft=0.51, e2e=0.6, tokens=10))
    assert not slo.met_by(ok(0, 0.0, ttft=0.1, e2e=0.1 + 9 * 0.06, tokens=10))
    assert not slo.met_by(failed(0, 0.0, TIMEOUT))


def test_summary_of_a_known_run() -> None:
    results = [
        ok(0, start=0.0, ttft=0.1, e2e=1.0, tokens=10),  # tpot 0.1
        ok(1, start=1.0, ttft=0.2, e2e=0.65, tokens=10),  # tpot 0.05
        ok(2, start=2.0, ttft=0.9, e2e=2.0, tokens=12, prompt_tokens=30),  # ends at 4.0, the run's end; tpot 0.1
        failed(3, start=2.5, cause=HTTP_5XX),
        failed(4, start=3.0, cause=OVERLOAD),
        failed(5, start=3.5, cause=OVERLOAD),
    ]
    summary = summarize(results, SLO(ttft_s=0.5, tpot_s=0.08), offered_rate=1.5)
    assert summary.requests == 6
    assert summary.completed == 3
    assert summary.errors == {OVERLOAD: 2, HTTP_5XX: 1}
    assert summary.duration_s == pytest.approx(4.0)
    assert summary.throughput_rps == pytest.approx(3 / 4.0)
    assert summary.output_tokens == 32
    assert summary.output_tokens_per_s == pytest.approx(32 / 4.0)
    assert summary.total_tokens_per_s == pytest.approx((32 + 50) / 4.0)
    assert summary.ttft.p[50] == pytest.approx(0.2)
    assert summary.e2e.p[50] == pytest.approx(1.0)
    assert summary.tpot.p[50] == pytest.approx(0.1)
    # only request 1 meets both objectives (request 0's TPOT of 0.1 s misses 0.08 s)
    assert summary.good == 1
    assert summary.goodput_rps == pytest.approx(1 / 4.0)
    assert summary.slo_attainment == pytest.approx(1 / 6)
    record = summary.as_json()
    assert record["failed"] == 3
    assert record["ttft_s"]["p90"] == pytest.approx(percentile([0.1, 0.2, 0.9], 90))


def test_arrival_lateness_is_reported() -> None:
    late = RequestResult(
        0, scheduled_s=1.0, start_s=1.25, prompt_kind="short", ttft_s=0.1, e2e_s=0.2, completion_tokens=2
    )
    assert summarize([late], SLO(1, 1), offered_rate=1.0).max_lateness_s == pytest.approx(0.25)


def test_summary_of_a_run_where_everything_failed() -> None:
    summary = summarize([failed(0, 0.0, TIMEOUT)], SLO(1, 1), offered_rate=1.0)
    assert summary.completed == 0
    assert summary.ttft.count == 0
    assert summary.as_json()["ttft_s"]["mean"] is None
    assert summary.goodput_rps == 0.0
