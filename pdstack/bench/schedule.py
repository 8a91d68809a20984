"""Open-loop arrival times: a seeded Poisson process, bounded by a request count and a duration."""

from __future__ import annotations

import numpy as np


class ScheduleError(ValueError):
    """An arrival schedule was asked for with impossible settings."""


def poisson_arrivals(rate: float, count: int, seed: int, max_duration_s: float | None = None) -> list[float]:
    """Arrival offsets in seconds from the run's start: exponential gaps of mean 1/rate.

    Stops after `count` arrivals or at `max_duration_s`, whichever comes first. The first request arrives after one
    gap, not at zero, so every gap is drawn from the same distribution.
    """
    if not rate > 0:
        raise ScheduleError(f"rate: must be a positive number of requests per second, got {rate}")
    if count < 1:
        raise ScheduleError(f"requests: must be at least 1, got {count}")
    if max_duration_s is not None and not max_duration_s > 0:
        raise ScheduleError(f"max duration: must be positive, got {max_duration_s}")
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, size=count))
    if max_duration_s is not None:
        times = times[times <= max_duration_s]
    return [float(t) for t in times]
