"""Synthetic prompts: reproducible, within their length distributions, distinct."""

from __future__ import annotations

import pytest

from pdstack.bench.workload import LONG, MIXED_LONG_SHARE, SHORT, BenchWorkloadError, make_prompts


def test_same_seed_same_prompts() -> None:
    assert make_prompts("mixed", 50, seed=4) == make_prompts("mixed", 50, seed=4)
    assert make_prompts("mixed", 50, seed=4) != make_prompts("mixed", 50, seed=5)


@pytest.mark.parametrize(("workload", "lengths"), [("short", SHORT), ("long", LONG)])
def test_lengths_stay_within_the_distribution(workload: str, lengths: object) -> None:
    prompts = make_prompts(workload, 200, seed=1)
    assert all(lengths.low <= p.words <= lengths.high for p in prompts)  # type: ignore[attr-defined]
    assert all(len(p.text.split()) == p.words for p in prompts)
    assert {p.kind for p in prompts} == {workload}


def test_mixed_draws_long_prompts_at_the_stated_share() -> None:
    prompts = make_prompts("mixed", 2000, seed=9)
    share = sum(p.kind == "long" for p in prompts) / len(prompts)
    # binomial standard deviation at n=2000 is about 0.01
    assert share == pytest.approx(MIXED_LONG_SHARE, abs=0.04)


def test_prompts_are_distinct_from_their_first_words() -> None:
    prompts = make_prompts("short", 100, seed=0)
    assert len({p.text.split(":")[0] for p in prompts}) == 100


def test_unknown_workload_is_refused_by_name() -> None:
    with pytest.raises(BenchWorkloadError, match=r"^workload: unknown 'huge'"):
        make_prompts("huge", 1, seed=0)
