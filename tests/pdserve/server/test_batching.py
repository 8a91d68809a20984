"""The step planner: decodes first, prompt chunks within the budget, short prompts first, no starvation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine import Engine, SamplingParams
from pdserve.server.batching import MIN_PREFILL_TOKENS, BatchScheduler, Sequence
from pdserve.server.metrics import ServerMetrics

BUDGET = 48


@pytest.fixture(scope="module")
def engine(make_checkpoint: Callable[..., Path]) -> Engine:
    return Engine.load(make_checkpoint("dense"))


def sequence(engine: Engine, prompt_tokens: int) -> Sequence:
    prompt = [5 + i % 50 for i in range(prompt_tokens)]
    # exactly four tokens each: a sampled EOS would end a sequence early (CI saw one finish after one token)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return Sequence(f"r{prompt_tokens}", prompt, engine.new_request(prompt, params), engine.new_cache())


def scheduler(engine: Engine) -> BatchScheduler:
    return BatchScheduler(engine, BUDGET, ServerMetrics(CollectorRegistry()))


def test_short_prompts_go_first_and_the_long_one_is_chunked(engine: Engine) -> None:
    planner = scheduler(engine)
    long, short_a, short_b = sequence(engine, 300), sequence(engine, 6), sequence(engine, 9)
    for item in (long, short_a, short_b):
        planner.add(item)
    chunks = dict(planner.plan().prefills)
    assert chunks[short_a] == 5 and chunks[short_b] == 8  # whole prompts but the last token (see batching.py)
    assert chunks[long] == BUDGET - 13  # the rest of the budget
    assert sum(chunks.values()) == BUDGET


def test_a_stream_of_short_prompts_cannot_starve_a_long_one(engine: Engine) -> None:
    planner = scheduler(engine)
    long = sequence(engine, 300)
    planner.add(long)
    for _ in range(5):
        for _ in range(8):
            planner.add(sequence(engine, 7))
        plan = planner.plan()
        assert dict(plan.prefills)[long] >= MIN_PREFILL_TOKENS
        assert plan.tokens <= BUDGET
        planner.execute(plan)
    assert long.cache.position >= 5 * MIN_PREFILL_TOKENS


def test_decoding_sequences_join_every_step_and_leave_when_finished(engine: Engine) -> None:
    planner = scheduler(engine)
    first, second = sequence(engine, 4), sequence(engine, 4)
    planner.add(first)
    planner.execute(planner.plan())  # prefill of prompt[:-1]
    planner.add(second)
    plan = planner.plan()
    assert plan.decodes == [first] and [s for s, _ in plan.prefills] == [second]
    planner.execute(plan)
    for _ in range(3):
        plan = planner.plan()
        assert set(plan.decodes) == {first, second}
        planner.execute(plan)
    assert first.state.finished and planner.plan().decodes == [second]
