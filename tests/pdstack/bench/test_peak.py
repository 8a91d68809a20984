"""The peak rule: the best throughput of a doubling concurrency ramp, stopping where throughput stops rising."""

from __future__ import annotations

import pytest

from pdstack.bench.client import RequestResult
from pdstack.bench.peak import ProbeStep, choose_peak, step_of


def step(concurrency: int, rps: float, requests: int = 100, errors: int = 0) -> ProbeStep:
    return ProbeStep(concurrency, requests, requests - errors, errors, rps)


def test_ramp_continues_while_throughput_rises() -> None:
    best, stop = choose_peak([step(1, 2.0), step(2, 3.8), step(4, 6.0)], min_gain=0.1, max_error_share=0.05)
    assert best == step(4, 6.0)
    assert stop == ""


def test_ramp_stops_when_doubling_gains_less_than_the_threshold() -> None:
    best, stop = choose_peak([step(1, 2.0), step(2, 3.8), step(4, 4.0)], min_gain=0.1, max_error_share=0.05)
    assert best == step(4, 4.0)  # still the highest throughput seen
    assert "rose less than 10%" in stop


def test_a_falling_step_keeps_the_earlier_peak() -> None:
    best, stop = choose_peak([step(1, 2.0), step(2, 3.8), step(4, 3.0)], min_gain=0.1, max_error_share=0.05)
    assert best == step(2, 3.8)
    assert stop.startswith("concurrency 4")


def test_a_failing_step_ends_the_ramp_at_the_last_good_one() -> None:
    best, stop = choose_peak([step(1, 2.0), step(2, 5.0, errors=20)], min_gain=0.1, max_error_share=0.05)
    assert best == step(1, 2.0)
    assert "20/100 requests failed" in stop


def test_throughput_counts_only_answers_inside_the_window() -> None:
    def answered(start: float, e2e: float) -> RequestResult:
        return RequestResult(0, start, start, "short", ttft_s=0.01, e2e_s=e2e, completion_tokens=2)

    results = [answered(0.0, 1.0), answered(1.0, 1.0), answered(2.0, 1.0), answered(3.5, 1.0)]  # last ends at 4.5
    probe = step_of(2, results, window_s=4.0)
    assert probe.answered_in_window == 3
    assert probe.throughput_rps == pytest.approx(0.75)
