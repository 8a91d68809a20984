"""Canary observations and verdicts from a real Prometheus holding deterministic gateway and server metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from pdstack.canary.judge import Outcome, judge
from pdstack.canary.prom import Prometheus, PrometheusError, duration_s, observe
from pdstack.cli import app
from pdstack.model import CanaryThresholds
from tests.pdstack.canary.promdata import SCRAPE_S, Traffic, openmetrics, prometheus_with
from tests.support import STACKS
from tests.support.ports import free_port

SCRAPES = 41  # ten minutes at 15 s
START = 1_700_000_000
END = START + (SCRAPES - 1) * SCRAPE_S
WINDOW = 300
TRAFFIC = [
    Traffic("v1", server="10.210.2.10:8100"),
    Traffic("v2-good", server="10.210.2.11:8100"),
    Traffic("v3-slow", ttft_s=0.4, itl_s=0.05),
    Traffic("v4-errors", error_share=0.1),
    Traffic("v5-kv", server="10.210.2.12:8100", kv_failures_per_scrape=1),
    Traffic("v6-idle", rps=0.02),
]


@pytest.fixture(scope="module")
def prom() -> Iterator[Prometheus]:
    with prometheus_with(openmetrics(TRAFFIC, START, SCRAPES), free_port()) as url:
        yield Prometheus(url)


def verdict_for(prom: Prometheus, canary: str) -> Outcome:
    seen_c = observe(prom, canary, WINDOW, END)
    seen_b = observe(prom, "v1", WINDOW, END)
    return judge(seen_c, seen_b, CanaryThresholds(), min_samples=50).outcome


def test_observations_count_requests_and_successes_over_the_window(prom: Prometheus) -> None:
    seen = observe(prom, "v4-errors", WINDOW, END)
    assert seen.requests == pytest.approx(10 * WINDOW, rel=0.02)
    assert seen.successes == pytest.approx(0.9 * seen.requests, rel=0.02)
    assert seen.kv_transfer_failures == 0


def test_latency_is_one_p95_per_step_near_the_generated_median(prom: Prometheus) -> None:
    seen = observe(prom, "v1", WINDOW, END, points=10)
    assert len(seen.ttft_p95_s) == 10
    assert all(0.05 < p < 0.25 for p in seen.ttft_p95_s)  # median 50 ms, bucket interpolation up to 250 ms
    slow = observe(prom, "v3-slow", WINDOW, END, points=10)
    assert min(slow.ttft_p95_s) > max(seen.ttft_p95_s)


def test_kv_failures_are_attributed_to_the_version_through_build_info(prom: Prometheus) -> None:
    assert observe(prom, "v5-kv", WINDOW, END).kv_transfer_failures == pytest.approx(WINDOW / SCRAPE_S, abs=2)
    assert observe(prom, "v2-good", WINDOW, END).kv_transfer_failures == 0


@pytest.mark.parametrize(
    ("canary", "expected"),
    [
        ("v2-good", Outcome.PASS),
        ("v3-slow", Outcome.FAIL),
        ("v4-errors", Outcome.FAIL),
        ("v5-kv", Outcome.FAIL),
        ("v6-idle", Outcome.INCONCLUSIVE),
    ],
)
def test_verdicts(prom: Prometheus, canary: str, expected: Outcome) -> None:
    assert verdict_for(prom, canary) is expected


def test_an_unknown_version_has_no_requests_and_is_inconclusive(prom: Prometheus) -> None:
    seen = observe(prom, "never-deployed", WINDOW, END)
    assert (seen.requests, seen.ttft_p95_s) == (0, [])


def test_a_bad_query_names_the_cause() -> None:
    with pytest.raises(PrometheusError, match=r"127\.0\.0\.1:9"):
        Prometheus("http://127.0.0.1:9", timeout_s=1).scalar("up", END)


def run_judge(prom: Prometheus, canary: str, *extra: str, end: int = END) -> tuple[int, str]:
    """`pdstack canary judge` with the local stack's policy (failure limit 2) over WINDOW-second windows, the first
    ending at `end`."""
    stacks = STACKS
    result = CliRunner().invoke(
        app,
        [
            "canary",
            "judge",
            "--prometheus",
            prom.url,
            "--canary",
            canary,
            "--baseline",
            "v1",
            "--stacks",
            str(stacks),
            "--env",
            "local",
            "--window",
            str(WINDOW),
            "--end",
            str(end),
            *extra,
        ],
    )
    return result.exit_code, result.output


def test_cli_exit_codes_follow_the_verdict(prom: Prometheus) -> None:
    assert run_judge(prom, "v2-good")[0] == 0
    assert run_judge(prom, "v6-idle")[0] == 3


def test_cli_failure_report_names_metric_values_and_threshold(prom: Prometheus) -> None:
    code, output = run_judge(prom, "v4-errors")
    assert code == 1
    line = next(line for line in output.splitlines() if line.startswith("FAIL success_rate_pct"))
    assert "canary 90" in line and "baseline 100" in line and "threshold >= 99" in line


def test_cli_judges_a_slow_canary_over_failure_limit_windows_in_a_row(prom: Prometheus) -> None:
    """The data holds two whole windows: the first ends at START + WINDOW, the second at END."""
    code, output = run_judge(prom, "v3-slow", "--json", end=START + WINDOW)
    verdict = json.loads(output)
    assert code == 1 and verdict["outcome"] == "fail"
    assert verdict["reason"] == "failed 2 window(s) in a row (failure limit 2)"
    assert [w["end"] for w in verdict["windows"]] == [START + WINDOW, END]
    for window in verdict["windows"]:
        failed = {c["metric"] for c in window["checks"] if c["outcome"] == "fail"}
        assert "ttft_p95_seconds" in failed
    assert "ttft_p95_seconds" in {c["metric"] for c in verdict["checks"] if c["outcome"] == "fail"}


def test_cli_a_slow_window_is_not_a_failure_until_the_next_one_is_judged(prom: Prometheus) -> None:
    """After END there is no traffic: the slow canary's second window is inconclusive, not a second failure."""
    code, output = run_judge(prom, "v3-slow", "--json")
    verdict = json.loads(output)
    assert (code, [w["outcome"] for w in verdict["windows"]]) == (3, ["fail", "inconclusive"])
    assert run_judge(prom, "v3-slow", "--failure-limit", "1")[0] == 1


def test_cli_errors_fail_on_the_first_window(prom: Prometheus) -> None:
    code, output = run_judge(prom, "v4-errors")
    assert code == 1
    assert output.splitlines()[0] == (
        "FAIL: canary v4-errors vs baseline v1 over 1 window(s) of 300 s: an error check failed, which fails at once"
    )


def test_cli_retries_inconclusive_windows_up_to_its_limit(prom: Prometheus) -> None:
    code, output = run_judge(prom, "v6-idle", "--inconclusive-limit", "1", "--json", end=START + WINDOW)
    verdict = json.loads(output)
    assert (code, len(verdict["windows"])) == (3, 2)
    assert verdict["reason"] == "inconclusive in 2 window(s) (retry limit 1)"


def test_cli_unreachable_prometheus_is_a_clear_error() -> None:
    code, output = run_judge(Prometheus("http://127.0.0.1:9"), "v2")
    assert code == 2 and "127.0.0.1:9" in output


def test_a_window_too_short_for_the_scrape_interval_is_refused_naming_both(prom: Prometheus) -> None:
    assert prom.scrape_interval_s() == SCRAPE_S
    with pytest.raises(ValueError, match=r"window: 60 s holds fewer than 3 latency points at a 15 s scrape interval"):
        observe(prom, "v1", 60, END)


@pytest.mark.parametrize(("text", "seconds"), [("5s", 5), ("1m30s", 90), ("500ms", 0.5), ("1h", 3600)])
def test_prometheus_durations(text: str, seconds: float) -> None:
    assert duration_s(text) == seconds


def test_a_malformed_duration_is_named() -> None:
    with pytest.raises(PrometheusError, match="not a Prometheus duration: '5 seconds'"):
        duration_s("5 seconds")
