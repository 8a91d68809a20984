from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pdserve.engine import Engine, RequestState, Sampler, SamplingParams
from pdserve.engine.sampling import StopMatcher


def logits_row(seed: int = 0, vocab: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(vocab).astype(np.float32) * 3


def test_greedy_is_argmax() -> None:
    row = logits_row()
    assert Sampler(SamplingParams(temperature=0)).sample(row) == int(np.argmax(row))
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=3)).sample(row) == int(np.argmax(row))


def test_seed_is_reproducible_and_seeds_differ() -> None:
    rows = [logits_row(i) for i in range(40)]
    params = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler(params).sample(r) for r in rows]  # fresh sampler per row
    s1, s2 = Sampler(params), Sampler(params)
    b = [s1.sample(r) for r in rows]
    assert b == [s2.sample(r) for r in rows]
    other = Sampler(SamplingParams(temperature=1.0, seed=99))
    assert b != [other.sample(r) for r in rows]
    assert len(set(a)) > 1


def test_top_k_restricts_support() -> None:
    row = logits_row(5)
    top3 = set(np.argsort(-row)[:3].tolist())
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    seen = {sampler.sample(row) for _ in range(300)}
    assert seen == top3


def test_top_p_restricts_support() -> None:
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    seen = {sampler.sample(row) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7, then 0.3 crosses it
    tiny = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=0))
    assert {tiny.sample(row) for _ in range(50)} == {0}


def test_temperature_sharpens() -> None:
    row = np.array([2.0, 1.0, 0.0], dtype=np.float32)
    cold = Sampler(SamplingParams(temperature=0.05, seed=0))
    assert {cold.sample(row) for _ in range(100)} == {0}
    hot = Sampler(SamplingParams(temperature=10.0, seed=0))
    assert {hot.sample(row) for _ in range(200)} == {0, 1, 2}


def test_sampling_frequencies_follow_the_distribution() -> None:
    probs = np.array([0.6, 0.3, 0.1])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=42))
    draws = np.bincount([sampler.sample(np.log(probs).astype(np.float32)) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(draws, probs, atol=0.03)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_params_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_single_stop_string_is_accepted() -> None:
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]


# -- request state: stop strings, eos, max_tokens, streaming ---------------------------------------------------------


def feed(engine: Engine, text_pieces: list[str], params: SamplingParams) -> tuple[RequestState, list[str]]:
    """Append the tokens of a scripted continuation one by one; return the state and the streamed deltas."""
    tok = engine.tokenizer
    ids = tok.encode("".join(text_pieces), add_special_tokens=False)
    state = engine.new_request(tok.encode("start:"), params)
    deltas = []
    for token in ids:
        out = state.append(token)
        deltas.append(out.text)
        if out.finished:
            break
    return state, deltas


def test_stop_string_truncates_and_finishes(load_engine: Any) -> None:
    engine = load_engine("hybrid")
    state, deltas = feed(
        engine, ["hello world the cache END and more text"], SamplingParams(max_tokens=100, stop=("END",))
    )
    assert state.finished and state.finish_reason == "stop"
    assert state.text == "hello world the cache "
    assert "".join(deltas) == state.text
    assert "E" not in "".join(deltas)


def test_stream_holds_back_partial_stop_strings(load_engine: Any) -> None:
    engine = load_engine("dense")
    text = "the cache answers slowly and then the ca"
    state, deltas = feed(engine, [text], SamplingParams(max_tokens=100, stop=("cache stop",)))
    assert not state.finished
    streamed = "".join(deltas)
    # "the cache" appeared earlier but did not continue with " stop", so it was released; the final "ca" is held
    assert state.text.endswith("the ca")
    assert streamed == state.text[: -len("ca")]
    assert "answers slowly" in streamed


def test_max_tokens_finishes_with_length(load_engine: Any) -> None:
    engine = load_engine("dense")
    result = engine.generate(
        engine.tokenizer.encode("hello"), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 5
    assert result.text == engine.tokenizer.decode(engine.tokenizer.encode("hello") + result.token_ids)[len("hello") :]


def test_eos_stops_unless_ignored(load_engine: Any) -> None:
    engine = load_engine("hybrid")
    assert engine.eos_token_ids  # from config, generation_config and tokenizer_config
    eos = engine.eos_token_ids[-1]
    state = engine.new_request([5, 6], SamplingParams(max_tokens=10))
    assert not state.append(7).finished
    out = state.append(eos)
    assert out.finished and out.finish_reason == "stop"
    ignoring = engine.new_request([5, 6], SamplingParams(max_tokens=10, ignore_eos=True))
    assert not ignoring.append(eos).finished


def test_stop_token_ids(load_engine: Any) -> None:
    engine = load_engine("dense")
    state = engine.new_request([1, 5], SamplingParams(max_tokens=10, stop_token_ids=(42,)))
    assert not state.append(41).finished
    assert state.append(42).finish_reason == "stop"
    with pytest.raises(RuntimeError):
        state.append(43)


def test_min_tokens_holds_back_every_way_to_stop(load_engine: Any) -> None:
    """vLLM's min_tokens: before that many tokens, EOS and stop_token_ids are never sampled and stop strings and
    stop ids do not end the request; from then on they do."""
    engine = load_engine("hybrid")
    eos = engine.eos_token_ids[-1]
    favour_eos = np.zeros(engine.config.vocab_size, dtype=np.float32)
    favour_eos[eos] = 10.0
    state = engine.new_request([5, 6], SamplingParams(temperature=0, max_tokens=10, min_tokens=2, stop_token_ids=(42,)))
    assert state.sample(favour_eos) != eos
    assert not state.append(42).finished  # the first token: a stop id does not end it yet
    assert state.sample(favour_eos) != eos
    assert not state.append(7).finished
    assert state.sample(favour_eos) == eos  # two tokens made: EOS may come now, and ends it
    assert state.append(eos).finish_reason == "stop"

    before = len(engine.tokenizer.encode("END and more ", add_special_tokens=False))
    stopping, _ = feed(engine, ["END and more END"], SamplingParams(max_tokens=100, stop=("END",), min_tokens=before))
    assert stopping.finish_reason == "stop" and stopping.text == "END and more "  # the first END came too early


def test_generate_is_reproducible_with_seed(kind: str, load_engine: Any) -> None:
    engine = load_engine(kind)
    ids = engine.tokenizer.encode("the quick server")
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=11, max_tokens=15, ignore_eos=True)
    a = engine.generate(ids, params)
    b = engine.generate(ids, params)
    c = engine.generate(
        ids, SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=12, max_tokens=15, ignore_eos=True)
    )
    assert a == b
    assert a.token_ids != c.token_ids
    streamed = "".join(o.text for o in engine.generate_stream(ids, params))
    assert streamed == a.text


def naive_hits(text: str, fed: int, stops: tuple[str, ...]) -> int | None:
    """Earliest start of a stop string that ends in text[fed:], searched the obvious quadratic way."""
    starts = [
        end - len(stop)
        for stop in stops
        for end in range(fed + 1, len(text) + 1)
        if end >= len(stop) and text[end - len(stop) : end] == stop
    ]
    return min(starts) if starts else None


def naive_held_back(text: str, stops: tuple[str, ...]) -> int:
    return max(
        (n for stop in stops for n in range(1, len(stop)) if n <= len(text) and text.endswith(stop[:n])), default=0
    )


@pytest.mark.parametrize("seed", range(30))
def test_stop_matcher_agrees_with_the_quadratic_search(seed: int) -> None:
    """Finding 3: the incremental matcher finds what slicing every prefix found, fed in pieces of any size."""
    rng = np.random.default_rng(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = tuple("".join(rng.choice(list(alphabet), int(rng.integers(1, 6)))) for _ in range(int(rng.integers(1, 5))))
    matcher, text = StopMatcher(stops), ""
    for _ in range(40):
        piece = "".join(rng.choice(list(alphabet), int(rng.integers(0, 4))))
        expected = naive_hits(text + piece, len(text), stops)
        text += piece
        assert matcher.feed(piece) == expected, (stops, text)
        assert matcher.held_back() == naive_held_back(text, stops), (stops, text)


def test_stop_strings_at_the_length_limit_that_the_text_keeps_almost_matching() -> None:
    """The text is held back while it might still become a stop string, and the match is found when it does."""
    stops = ("a" * 255 + "b",) * 4
    matcher = StopMatcher(stops)
    assert matcher.feed("a" * 3000) is None
    assert matcher.held_back() == 255
    assert matcher.feed("b") == 3001 - 256
    assert matcher.held_back() == 0
