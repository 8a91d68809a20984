"""The canary judge: thresholds plus a Mann-Whitney test with a minimum sample size."""

from __future__ import annotations

import numpy as np

from pdstack.canary.judge import Observations, Outcome, judge
from pdstack.model import CanaryThresholds

THRESHOLDS = CanaryThresholds(
    success_rate_min_pct=99.0,
    ttft_p95_max_ratio=1.2,
    itl_p95_max_ratio=1.2,
    kv_transfer_failures_max=0,
    confidence=0.98,
)


def latencies(center: float, n: int = 30, seed: int = 0) -> list[float]:
    return list(np.random.default_rng(seed).normal(center, center * 0.05, n))


def obs(
    *,
    requests: int = 500,
    successes: int = 500,
    kv_failures: int = 0,
    ttft: float = 0.2,
    itl: float = 0.02,
    seed: int = 0,
) -> Observations:
    return Observations(requests, successes, kv_failures, latencies(ttft, seed=seed), latencies(itl, seed=seed + 1))


def test_equal_versions_pass() -> None:
    verdict = judge(obs(seed=1), obs(seed=2), THRESHOLDS, min_samples=50)
    assert verdict.outcome is Outcome.PASS, verdict.report()


def test_slow_canary_fails_naming_metric_both_values_and_threshold() -> None:
    verdict = judge(obs(ttft=0.5, seed=1), obs(ttft=0.2, seed=2), THRESHOLDS, min_samples=50)
    assert verdict.outcome is Outcome.FAIL
    failing = [c for c in verdict.checks if c.outcome is Outcome.FAIL]
    assert [c.metric for c in failing] == ["ttft_p95_seconds"]
    line = failing[0].line()
    assert line.startswith("FAIL ttft_p95_seconds: canary 0.5")
    assert "vs baseline 0.2" in line and "threshold <= 1.2x baseline" in line


def test_small_but_significant_slowdown_within_ratio_passes() -> None:
    verdict = judge(obs(ttft=0.22, seed=1), obs(ttft=0.2, seed=2), THRESHOLDS, min_samples=50)
    ttft = next(c for c in verdict.checks if c.metric == "ttft_p95_seconds")
    assert ttft.outcome is Outcome.PASS, ttft.line()


def test_one_noisy_spike_is_not_significant() -> None:
    canary = obs(seed=1)
    spiky = Observations(canary.requests, canary.successes, 0, [0.2, 0.21, 0.19, 0.9], canary.itl_p95_s)
    verdict = judge(spiky, obs(seed=2), THRESHOLDS, min_samples=50)
    ttft = next(c for c in verdict.checks if c.metric == "ttft_p95_seconds")
    assert ttft.outcome is Outcome.PASS, ttft.line()


def test_errors_fail_the_success_rate() -> None:
    verdict = judge(obs(successes=480), obs(), THRESHOLDS, min_samples=50)
    assert verdict.outcome is Outcome.FAIL
    assert "FAIL success_rate_pct: canary 96 vs baseline 100, threshold >= 99.0" in verdict.report()


def test_kv_transfer_failures_fail() -> None:
    verdict = judge(obs(kv_failures=3), obs(), THRESHOLDS, min_samples=50)
    assert "FAIL kv_transfer_failures: canary 3 vs baseline 0, threshold <= 0" in verdict.report()


def test_too_few_requests_is_inconclusive_never_pass() -> None:
    verdict = judge(obs(requests=10, successes=10), obs(), THRESHOLDS, min_samples=50)
    assert verdict.outcome is Outcome.INCONCLUSIVE
    assert verdict.checks[0].metric == "sample_size"


def test_failures_that_already_decide_the_success_rate_fail_before_the_sample_is_complete() -> None:
    # 1 failure in 8 requests: even with 42 more successes, 49 of 50 is 98 % < 99 %.
    verdict = judge(obs(requests=8, successes=7), obs(requests=20, successes=20), THRESHOLDS, min_samples=50)
    assert verdict.outcome is Outcome.FAIL
    assert verdict.report() == (
        "FAIL success_rate_pct: canary 87.5 vs baseline 100, threshold >= 99.0 "
        "(1 of 8 requests failed: at most 98 % over 50 requests)"
    )
    # still within reach (1 failure in 100 possible): too few requests stays inconclusive
    lenient = THRESHOLDS.model_copy(update={"success_rate_min_pct": 98.0})
    assert judge(obs(requests=8, successes=7), obs(), lenient, min_samples=50).outcome is Outcome.INCONCLUSIVE


def test_too_few_latency_points_is_inconclusive() -> None:
    short = Observations(500, 500, 0, [0.2, 0.2], [0.02, 0.02])
    assert judge(short, obs(), THRESHOLDS, min_samples=50).outcome is Outcome.INCONCLUSIVE
