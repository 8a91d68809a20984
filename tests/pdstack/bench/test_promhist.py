"""Reading a server's latency histograms and placing a run's percentiles in their buckets."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdstack.bench.client import RequestResult
from pdstack.bench.promhist import E2E_HINTS, TTFT_HINTS, check_run, compare, find_histogram, parse_histograms

BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0)


def page(observations: dict[str, list[float]], labelled: bool = False) -> str:
    """A real /metrics page, rendered by prometheus_client from the given observations."""
    registry = CollectorRegistry()
    for name, values in observations.items():
        if labelled:
            histogram = Histogram(name, "test", ["model"], buckets=BUCKETS, registry=registry)
            for i, value in enumerate(values):
                histogram.labels(f"m{i % 2}").observe(value)
        else:
            plain = Histogram(name, "test", buckets=BUCKETS, registry=registry)
            for value in values:
                plain.observe(value)
    return generate_latest(registry).decode()


def test_buckets_are_read_and_summed_over_labels() -> None:
    values = [0.005, 0.02, 0.03, 0.2, 0.7, 3.0]
    histograms = parse_histograms(page({"srv_time_to_first_token_seconds": values}, labelled=True))
    hist = histograms["srv_time_to_first_token_seconds"]
    assert hist.buckets == ((0.01, 1), (0.05, 3), (0.1, 3), (0.5, 4), (1.0, 5), (math.inf, 6))
    assert hist.count == 6


def test_the_difference_of_two_scrapes_holds_only_the_run() -> None:
    before = parse_histograms(page({"lat_seconds": [0.02] * 5}))["lat_seconds"]
    after = parse_histograms(page({"lat_seconds": [0.02] * 5 + [0.3] * 4}))["lat_seconds"]
    run = after.minus(before)
    assert run.count == 4
    assert run.quantile_bucket(50) == (0.1, 0.5)


def test_quantile_bucket_holds_the_nearest_rank_observation() -> None:
    values = [0.005] * 50 + [0.07] * 40 + [0.8] * 10
    hist = parse_histograms(page({"lat_seconds": values}))["lat_seconds"]
    assert hist.quantile_bucket(50) == (0.0, 0.01)
    assert hist.quantile_bucket(90) == (0.05, 0.1)
    assert hist.quantile_bucket(99) == (0.5, 1.0)
    assert parse_histograms(page({"x_seconds": [5.0]}))["x_seconds"].quantile_bucket(99) == (1.0, math.inf)


def test_the_sum_gives_the_servers_mean() -> None:
    hist = parse_histograms(page({"lat_seconds": [0.1, 0.2, 0.6]}, labelled=True))["lat_seconds"]
    assert hist.mean == pytest.approx(0.3)


def test_compare_agrees_when_bench_values_are_the_observed_ones() -> None:
    values = [0.004, 0.02, 0.03, 0.04, 0.06, 0.2, 0.3, 0.6, 0.7, 0.99]
    hist = parse_histograms(page({"lat_seconds": values}))["lat_seconds"]
    checks = compare(hist, "ttft", values, (50, 90, 99), allowance_s=0.0)
    assert [c.mean_offset_s for c in checks] == pytest.approx([0.0] * 3)
    assert all(check.agrees for check in checks)


def test_a_client_side_delay_within_the_allowance_agrees_and_beyond_it_does_not() -> None:
    values = [0.004, 0.02, 0.03, 0.04, 0.06, 0.2, 0.3, 0.6, 0.7, 0.99]
    hist = parse_histograms(page({"lat_seconds": values}))["lat_seconds"]
    seen_by_client = [v + 0.02 for v in values]  # p99 (0.99) crosses the 1.0 s bucket bound
    checks = compare(hist, "ttft", seen_by_client, (50, 90, 99), allowance_s=0.025)
    assert checks[0].mean_offset_s == pytest.approx(0.02)
    assert all(check.agrees for check in checks)
    assert not compare(hist, "ttft", seen_by_client, (99,), allowance_s=0.005)[0].agrees


def test_a_client_cannot_see_a_token_before_the_server_made_it() -> None:
    values = [0.2] * 10
    hist = parse_histograms(page({"lat_seconds": values}))["lat_seconds"]
    assert not compare(hist, "ttft", [0.09] * 10, (50,), allowance_s=1.0)[0].agrees


def test_a_distribution_of_another_shape_disagrees_even_with_the_same_mean() -> None:
    values = [0.02] * 50 + [0.07] * 40 + [0.3] * 10
    hist = parse_histograms(page({"lat_seconds": values}))["lat_seconds"]
    other = [0.068] * 100
    checks = {c.q: c for c in compare(hist, "e2e", other, (50, 90, 99), allowance_s=0.005)}
    assert checks[50].mean_offset_s == pytest.approx(0.0, abs=1e-9)
    assert not checks[50].agrees and not checks[99].agrees


def test_latency_histograms_are_found_by_name() -> None:
    names = {
        "pdserve_time_to_first_token_seconds": [0.1],
        "pdserve_request_duration_seconds": [0.2],
        "pdserve_step_duration_seconds": [0.01],
        "vllm:e2e_request_latency_seconds": [0.3],
    }
    histograms = parse_histograms(page({n.replace(":", "_"): v for n, v in names.items()}))
    assert find_histogram(histograms, None, TTFT_HINTS) == "pdserve_time_to_first_token_seconds"
    assert find_histogram(histograms, None, E2E_HINTS) == "pdserve_request_duration_seconds"
    assert find_histogram(histograms, "pdserve_step_duration_seconds", E2E_HINTS) == "pdserve_step_duration_seconds"
    assert find_histogram(histograms, "missing_seconds", E2E_HINTS) is None


def test_an_empty_histogram_has_no_quantile() -> None:
    hist = parse_histograms(page({"lat_seconds": []}))["lat_seconds"]
    with pytest.raises(ValueError, match="no observations"):
        hist.quantile_bucket(50)


def answered(ttft: float, e2e: float, first_event: float) -> RequestResult:
    return RequestResult(0, 0.0, 0.0, "short", first_event_s=first_event, ttft_s=ttft, e2e_s=e2e, completion_tokens=8)


def test_check_run_compares_the_run_only_and_names_what_it_could_not_compare() -> None:
    before = parse_histograms(
        page({"srv_time_to_first_token_seconds": [9.0] * 3, "srv_request_duration_seconds": [9.0] * 3})
    )
    run = [answered(0.03, 0.3, 0.002), answered(0.04, 0.4, 0.003)]
    after = parse_histograms(
        page(
            {
                "srv_time_to_first_token_seconds": [9.0] * 3 + [0.03, 0.04],
                "srv_request_duration_seconds": [9.0] * 3 + [0.3, 0.4],
            }
        )
    )
    checks, notes = check_run(after, before, run, (None, None), step_s=0.01)
    assert notes == []
    verdicts = {(c.measure, c.q): c.agrees for c in checks}
    assert verdicts[("ttft", 50)] and verdicts[("ttft", 99)] and verdicts[("e2e", 99)]
    # the first event came long before the first token: a TTFT histogram does not describe it
    assert not verdicts[("first_event", 50)]
    assert all(c.allowance_s == pytest.approx(0.015) for c in checks)

    only_ttft = parse_histograms(page({"srv_time_to_first_token_seconds": [0.03]}))
    checks, notes = check_run(only_ttft, {}, run, (None, None), step_s=0.0)
    assert any("no histogram matching" in note for note in notes)
    assert any("counted 1 requests during the run, the bench had 2 answered" in note for note in notes)
