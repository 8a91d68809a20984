"""Find the endpoint's peak request rate with a closed-loop concurrency ramp.

Definition: the peak is the highest throughput (answered requests per second) seen while concurrency doubles from 1,
stopping once doubling raises throughput by less than `min_gain` (throughput has stopped rising), a step has more
than `max_error_share` of its requests failing, or `max_concurrency` is reached. Open-loop runs at 50/80/100 % of it
then load the server at known fractions of what it can answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdstack.bench.client import RequestResult
from pdstack.bench.endpoint import Endpoint
from pdstack.bench.runner import LoadSettings, run_closed_loop
from pdstack.bench.workload import Prompt


class PeakError(RuntimeError):
    """The probe found no rate the endpoint sustains (every step failed)."""


@dataclass(frozen=True)
class ProbeStep:
    concurrency: int
    requests: int
    answered_in_window: int
    errors: int
    throughput_rps: float

    def as_json(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "answered_in_window": self.answered_in_window,
            "errors": self.errors,
            "throughput_rps": self.throughput_rps,
        }


@dataclass(frozen=True)
class Peak:
    rate_rps: float
    concurrency: int
    steps: tuple[ProbeStep, ...]
    step_seconds: float
    stop_reason: str

    def as_json(self) -> dict[str, Any]:
        return {
            "rate_rps": self.rate_rps,
            "concurrency": self.concurrency,
            "step_seconds": self.step_seconds,
            "stop_reason": self.stop_reason,
            "definition": "highest closed-loop throughput while doubling concurrency until it stops rising",
            "steps": [s.as_json() for s in self.steps],
        }


def step_of(concurrency: int, results: Sequence[RequestResult], window_s: float) -> ProbeStep:
    """Throughput counts the answers that ended inside the window; the drain after it would understate it."""
    answered = sum(1 for r in results if r.ok and r.e2e_s is not None and r.start_s + r.e2e_s <= window_s)
    errors = sum(1 for r in results if not r.ok)
    return ProbeStep(concurrency, len(results), answered, errors, answered / window_s)


def choose_peak(steps: Sequence[ProbeStep], min_gain: float, max_error_share: float) -> tuple[ProbeStep | None, str]:
    """The best step of a ramp, and why the ramp stopped (or should stop) after the last step."""
    best: ProbeStep | None = None
    for step in steps:
        if step.requests and step.errors / step.requests > max_error_share:
            return best, f"concurrency {step.concurrency}: {step.errors}/{step.requests} requests failed"
        if best is not None and step.throughput_rps < best.throughput_rps * (1 + min_gain):
            if step.throughput_rps > best.throughput_rps:
                best = step
            return best, f"concurrency {step.concurrency}: throughput rose less than {min_gain:.0%}"
        best = step
    return best, ""


def measure_peak(
    endpoint: Endpoint,
    prompts: Sequence[Prompt],
    settings: LoadSettings,
    *,
    step_seconds: float,
    max_concurrency: int,
    min_gain: float = 0.1,
    max_error_share: float = 0.05,
    on_step: Callable[[ProbeStep], None] | None = None,
) -> Peak:
    steps: list[ProbeStep] = []
    concurrency = 1
    reason = f"reached the concurrency cap {max_concurrency}"
    while concurrency <= max_concurrency:
        results, _ = asyncio.run(run_closed_loop(endpoint, prompts, concurrency, step_seconds, settings))
        steps.append(step_of(concurrency, results, step_seconds))
        if on_step is not None:
            on_step(steps[-1])
        _, stop = choose_peak(steps, min_gain, max_error_share)
        if stop:
            reason = stop
            break
        concurrency *= 2
    best, _ = choose_peak(steps, min_gain, max_error_share)
    if best is None or best.throughput_rps <= 0:
        raise PeakError(f"peak: no concurrency level was answered without errors ({reason})")
    return Peak(best.throughput_rps, best.concurrency, tuple(steps), step_seconds, reason)
