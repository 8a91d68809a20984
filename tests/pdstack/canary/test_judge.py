"""The canary judge: thresholds plus a Mann-Whitney test with a minimum sample size; a step over consecutive
windows until one decides."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from pdstack.canary.judge import Observations, Outcome, Verdict, judge, judge_step
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


# One window's verdicts, each from the judge itself: a good canary, a slow one, one with too few requests.
PASSING = judge(obs(seed=1), obs(seed=2), THRESHOLDS, min_samples=50)
SLOW = judge(obs(ttft=0.5, seed=1), obs(ttft=0.2, seed=2), THRESHOLDS, min_samples=50)
SPARSE = judge(obs(requests=10, successes=10), obs(), THRESHOLDS, min_samples=50)


class Windows:
    """Verdicts handed out one window at a time, counting how many the step asked for."""

    def __init__(self, verdicts: Sequence[Verdict]) -> None:
        self.verdicts, self.judged = verdicts, 0

    def __iter__(self) -> Iterator[Verdict]:
        for verdict in self.verdicts:
            self.judged += 1
            yield verdict


def test_a_slow_window_then_a_passing_one_passes_the_step() -> None:
    step = judge_step(Windows([SLOW, PASSING, SLOW]), failure_limit=2)
    assert (step.outcome, len(step.windows)) == (Outcome.PASS, 2)
    report = step.report()
    assert report.startswith("window 1: fail\n") and "\nwindow 2: pass\n" in report
    assert report.count("FAIL ttft_p95_seconds") == 1


def test_latency_failing_failure_limit_windows_in_a_row_fails_and_judges_no_further() -> None:
    windows = Windows([SLOW] * 5)
    step = judge_step(windows, failure_limit=3)
    assert (step.outcome, windows.judged) == (Outcome.FAIL, 3)
    assert step.reason == "failed 3 window(s) in a row (failure limit 3)"
    assert step.report().count("FAIL ttft_p95_seconds") == 3


def test_a_failure_limit_of_one_fails_on_the_first_slow_window() -> None:
    assert judge_step(Windows([SLOW, PASSING]), failure_limit=1).outcome is Outcome.FAIL


@pytest.mark.parametrize(
    "errors",
    [
        # beyond reach before the sample is complete: 1 of 8 failed, at most 98 % over 50 requests
        judge(obs(requests=8, successes=7), obs(requests=20, successes=20), THRESHOLDS, min_samples=50),
        judge(obs(successes=480), obs(), THRESHOLDS, min_samples=50),  # 96 % over a complete sample
        judge(obs(kv_failures=3), obs(), THRESHOLDS, min_samples=50),
    ],
)
def test_a_failed_error_check_fails_the_step_at_once(errors: Verdict) -> None:
    windows = Windows([errors, PASSING])
    step = judge_step(windows, failure_limit=3)
    assert (step.outcome, windows.judged) == (Outcome.FAIL, 1)
    assert step.reason == "an error check failed, which fails at once"


def test_inconclusive_windows_are_retried_up_to_the_limit_and_then_end_the_step_inconclusive() -> None:
    assert judge_step(Windows([SPARSE, SPARSE, PASSING]), failure_limit=2, inconclusive_limit=2).outcome is Outcome.PASS
    windows = Windows([SPARSE, SPARSE, SPARSE, PASSING])
    step = judge_step(windows, failure_limit=2, inconclusive_limit=2)
    assert (step.outcome, windows.judged) == (Outcome.INCONCLUSIVE, 3)
    assert judge_step(Windows([SPARSE, PASSING]), failure_limit=2).outcome is Outcome.INCONCLUSIVE  # no retry


def test_an_inconclusive_window_between_slow_ones_neither_counts_nor_breaks_the_run() -> None:
    windows = Windows([SLOW, SPARSE, SLOW, PASSING])
    step = judge_step(windows, failure_limit=2, inconclusive_limit=1)
    assert (step.outcome, windows.judged) == (Outcome.FAIL, 3)


def test_windows_running_out_undecided_is_inconclusive_never_a_pass() -> None:
    step = judge_step(Windows([SLOW]), failure_limit=2)
    assert (step.outcome, step.reason) == (Outcome.INCONCLUSIVE, "no window left to judge")


def test_limits_below_their_minimum_are_refused() -> None:
    with pytest.raises(ValueError, match="failure_limit must be >= 1"):
        judge_step(Windows([PASSING]), failure_limit=0)
    with pytest.raises(ValueError, match="inconclusive_limit >= 0"):
        judge_step(Windows([PASSING]), failure_limit=1, inconclusive_limit=-1)
