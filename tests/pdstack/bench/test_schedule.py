"""The Poisson arrival schedule: reproducible, the asked-for mean rate, exponential gaps, bounded."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats

from pdstack.bench.schedule import ScheduleError, poisson_arrivals


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    assert poisson_arrivals(5.0, 200, seed=7) == poisson_arrivals(5.0, 200, seed=7)
    assert poisson_arrivals(5.0, 200, seed=7) != poisson_arrivals(5.0, 200, seed=8)


def test_arrivals_increase_and_the_first_comes_after_a_gap() -> None:
    times = poisson_arrivals(10.0, 500, seed=1)
    assert times[0] > 0
    assert all(b > a for a, b in itertools.pairwise(times))


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_mean_rate_within_statistical_bounds(rate: float) -> None:
    # n exponential gaps: the mean gap has standard deviation (1/rate)/sqrt(n); allow five of them
    n = 20_000
    gaps = np.diff([0.0, *poisson_arrivals(rate, n, seed=11)])
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / np.sqrt(n)
    assert n / poisson_arrivals(rate, n, seed=11)[-1] == pytest.approx(rate, rel=5 / np.sqrt(n))


def test_gaps_are_exponential_not_evenly_spaced() -> None:
    rate = 3.0
    gaps = np.diff([0.0, *poisson_arrivals(rate, 5_000, seed=5)])
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 0.001
    # the coefficient of variation of exponential gaps is 1 (a fixed-interval schedule would give 0)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


def test_counts_in_equal_windows_are_poisson() -> None:
    rate, window = 4.0, 1.0
    times = np.array(poisson_arrivals(rate, 40_000, seed=2))
    counts = np.bincount((times // window).astype(int))[:-1]  # drop the last, partial window
    # Poisson counts have variance equal to their mean
    assert counts.mean() == pytest.approx(rate * window, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.08)


def test_duration_bounds_the_schedule() -> None:
    times = poisson_arrivals(10.0, 10_000, seed=3, max_duration_s=5.0)
    assert times[-1] <= 5.0
    assert 30 < len(times) < 80  # about 50 arrivals in 5 s at 10 req/s


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rate": 0.0, "count": 5}, "rate"),
        ({"rate": -1.0, "count": 5}, "rate"),
        ({"rate": 1.0, "count": 0}, "requests"),
        ({"rate": 1.0, "count": 5, "max_duration_s": 0.0}, "max duration"),
    ],
)
def test_impossible_settings_are_refused_by_name(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ScheduleError, match=f"^{field}:"):
        poisson_arrivals(seed=0, **kwargs)  # type: ignore[arg-type]
