"""The canary judge: compare a canary with its baseline, metric by metric, the way Kayenta and Flagger do.

Each latency metric arrives as two samples (one value per scrape step over the analysis window, per version). A metric
fails only when both hold: the canary's p95 exceeds the baseline's by more than the allowed ratio, *and* a one-sided
Mann-Whitney U test says the canary's values are larger at the configured confidence. The ratio alone flaps on noise;
the test alone fails on differences too small to matter. Counters (success rate, KV transfer failures) are judged
against absolute thresholds. Too few requests make the verdict inconclusive, never a pass, unless the canary's
failures already put its success rate beyond reach: that fails at once.

A canary step judges consecutive windows until one decides (`judge_step`), as Flagger's `threshold` and Argo
Rollouts' `failureLimit` do: a pass ends the step, a latency failure must repeat in `failure_limit` windows in a row
before it fails the step (one slow window is noise, not a bad release), and a failed error check (success rate, KV
transfer failures) fails it at once: errors are not noise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum

from pdstack.model import CanaryThresholds


class Outcome(StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Check:
    metric: str
    outcome: Outcome
    canary: float | None
    baseline: float | None
    threshold: str
    detail: str = ""

    def line(self) -> str:
        def fmt(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4g}"

        return (
            f"{self.outcome.upper()} {self.metric}: canary {fmt(self.canary)} vs baseline {fmt(self.baseline)}, "
            f"threshold {self.threshold}" + (f" ({self.detail})" if self.detail else "")
        )


@dataclass(frozen=True)
class Observations:
    """What the judge needs for one version over one analysis window."""

    requests: int
    successes: int
    kv_transfer_failures: int
    ttft_p95_s: Sequence[float]
    itl_p95_s: Sequence[float]


ERROR_METRICS = frozenset({"success_rate_pct", "kv_transfer_failures"})
"""Checks of errors, judged against absolute thresholds: one failing window fails its step."""


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    checks: list[Check] = field(default_factory=list)

    @property
    def fails_at_once(self) -> bool:
        """A failed error check: no later window is waited for."""
        return any(c.outcome is Outcome.FAIL and c.metric in ERROR_METRICS for c in self.checks)

    def report(self) -> str:
        return "\n".join(check.line() for check in self.checks)

    def as_json(self) -> dict[str, object]:
        return {"outcome": self.outcome, "checks": [asdict(c) for c in self.checks], "report": self.report()}


@dataclass(frozen=True)
class StepVerdict:
    """One canary step: the windows judged in turn, and why the last one decided."""

    outcome: Outcome
    reason: str
    windows: list[Verdict]

    def report(self) -> str:
        """Each window's outcome, then its checks."""
        lines: list[str] = []
        for number, window in enumerate(self.windows, 1):
            lines += [f"window {number}: {window.outcome}", window.report()]
        return "\n".join(lines)


def judge_step(windows: Iterable[Verdict], failure_limit: int, inconclusive_limit: int = 0) -> StepVerdict:
    """Take verdicts of consecutive windows until one decides the step: a pass; a failed error check; the
    `failure_limit`-th failure in a row; or an inconclusive window beyond the `inconclusive_limit` retries
    (inconclusive windows neither count as failures nor break a run of them). `windows` is read lazily: a window
    not needed is never judged."""
    if failure_limit < 1 or inconclusive_limit < 0:
        raise ValueError(
            f"failure_limit must be >= 1 and inconclusive_limit >= 0, got {failure_limit}, {inconclusive_limit}"
        )
    seen: list[Verdict] = []
    failed = inconclusive = 0
    for verdict in windows:
        seen.append(verdict)
        if verdict.outcome is Outcome.PASS:
            return StepVerdict(Outcome.PASS, "passed", seen)
        if verdict.fails_at_once:
            return StepVerdict(Outcome.FAIL, "an error check failed, which fails at once", seen)
        if verdict.outcome is Outcome.FAIL:
            failed += 1
            if failed >= failure_limit:
                reason = f"failed {failed} window(s) in a row (failure limit {failure_limit})"
                return StepVerdict(Outcome.FAIL, reason, seen)
        else:
            inconclusive += 1
            if inconclusive > inconclusive_limit:
                reason = f"inconclusive in {inconclusive} window(s) (retry limit {inconclusive_limit})"
                return StepVerdict(Outcome.INCONCLUSIVE, reason, seen)
    return StepVerdict(Outcome.INCONCLUSIVE, "no window left to judge", seen)


def judge(canary: Observations, baseline: Observations, thresholds: CanaryThresholds, min_samples: int) -> Verdict:
    if canary.requests < min_samples or baseline.requests < min_samples:
        beyond_reach = _success_rate_beyond_reach(canary, baseline, thresholds.success_rate_min_pct, min_samples)
        if beyond_reach is not None:
            return Verdict(Outcome.FAIL, [beyond_reach])
        check = Check(
            "sample_size",
            Outcome.INCONCLUSIVE,
            canary.requests,
            baseline.requests,
            f">= {min_samples}",
            "too few requests to judge",
        )
        return Verdict(Outcome.INCONCLUSIVE, [check])
    checks = [
        _success_rate(canary, baseline, thresholds.success_rate_min_pct),
        _kv_failures(canary, baseline, thresholds.kv_transfer_failures_max),
        _latency(
            "ttft_p95_seconds",
            canary.ttft_p95_s,
            baseline.ttft_p95_s,
            thresholds.ttft_p95_max_ratio,
            thresholds.confidence,
        ),
        _latency(
            "itl_p95_seconds", canary.itl_p95_s, baseline.itl_p95_s, thresholds.itl_p95_max_ratio, thresholds.confidence
        ),
    ]
    outcomes = {c.outcome for c in checks}
    overall = (
        Outcome.FAIL
        if Outcome.FAIL in outcomes
        else Outcome.INCONCLUSIVE
        if Outcome.INCONCLUSIVE in outcomes
        else Outcome.PASS
    )
    return Verdict(overall, checks)


def _success_rate(canary: Observations, baseline: Observations, min_pct: float) -> Check:
    rate_c = 100.0 * canary.successes / canary.requests
    rate_b = 100.0 * baseline.successes / baseline.requests if baseline.requests else None
    outcome = Outcome.PASS if rate_c >= min_pct else Outcome.FAIL
    return Check("success_rate_pct", outcome, rate_c, rate_b, f">= {min_pct}")


def _success_rate_beyond_reach(
    canary: Observations, baseline: Observations, min_pct: float, min_samples: int
) -> Check | None:
    """A FAIL before the sample is complete when the canary's failures already decide it: even if every request still
    missing succeeded, its success rate would stay below the threshold. A failing canary that the gateway routes
    around (it suspends instances that fail) would otherwise starve itself of samples and end inconclusive."""
    samples = max(min_samples, canary.requests)
    failures = canary.requests - canary.successes
    best_pct = 100.0 * (samples - failures) / samples
    if best_pct >= min_pct:
        return None
    detail = f"{failures} of {canary.requests} requests failed: at most {best_pct:.4g} % over {samples} requests"
    return replace(_success_rate(canary, baseline, min_pct), detail=detail)  # FAIL: the rate so far is lower still


def _kv_failures(canary: Observations, baseline: Observations, max_failures: int) -> Check:
    outcome = Outcome.PASS if canary.kv_transfer_failures <= max_failures else Outcome.FAIL
    return Check(
        "kv_transfer_failures",
        outcome,
        canary.kv_transfer_failures,
        baseline.kv_transfer_failures,
        f"<= {max_failures}",
    )


def _latency(
    metric: str, canary: Sequence[float], baseline: Sequence[float], max_ratio: float, confidence: float
) -> Check:
    # numpy and scipy.stats take ~1 s to load: only a judgement pays it, not every `pdstack` command.
    import numpy as np  # noqa: PLC0415
    from scipy.stats import mannwhitneyu  # noqa: PLC0415

    values_c = np.asarray([v for v in canary if np.isfinite(v)], dtype=float)
    values_b = np.asarray([v for v in baseline if np.isfinite(v)], dtype=float)
    if len(values_c) < 3 or len(values_b) < 3:
        return Check(
            metric,
            Outcome.INCONCLUSIVE,
            None,
            None,
            f"<= {max_ratio}x baseline",
            f"{len(values_c)} canary and {len(values_b)} baseline points, need 3 each",
        )
    p95_c, p95_b = float(np.percentile(values_c, 95)), float(np.percentile(values_b, 95))
    ratio = p95_c / p95_b if p95_b > 0 else float("inf")
    p_value = float(mannwhitneyu(values_c, values_b, alternative="greater").pvalue)
    significant = p_value < 1 - confidence
    outcome = Outcome.FAIL if ratio > max_ratio and significant else Outcome.PASS
    detail = f"ratio {ratio:.2f}, Mann-Whitney p={p_value:.3g}, significant below {1 - confidence:.3g}"
    return Check(metric, outcome, p95_c, p95_b, f"<= {max_ratio}x baseline", detail)
