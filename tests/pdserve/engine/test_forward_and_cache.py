"""The batched step, chunked prefill and the KV cache (no torch needed)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from pdserve.engine import Engine, EngineError, KVCache, KVCacheError, SamplingParams
from pdserve.engine.kv_cache import KVCacheSpec

TEXT = "the quick server sends a request to the cache and the cache answers slowly over the network today"


def prompt(engine: Engine, n: int = 24) -> list[int]:
    ids = engine.tokenizer.encode(TEXT * 2)
    assert len(ids) >= n
    return ids[:n]


def assert_caches_equal(a: KVCache, b: KVCache, atol: float = 1e-5) -> None:
    assert a.position == b.position
    for (ka, va), (kb, vb) in zip(a.layers(), b.layers(), strict=True):
        assert ka.shape == kb.shape
        np.testing.assert_allclose(ka, kb, atol=atol, rtol=0)
        np.testing.assert_allclose(va, vb, atol=atol, rtol=0)


@pytest.mark.parametrize("chunk", [1, 3, 7, 10])
def test_chunked_prefill_equals_one_shot(kind: str, chunk: int, load_engine: Any) -> None:
    engine = load_engine(kind)
    ids = prompt(engine)
    one_logits, one_cache = engine.prefill(ids)
    chunk_logits, chunk_cache = engine.prefill(ids, chunk_size=chunk)
    np.testing.assert_allclose(chunk_logits, one_logits, atol=1e-4, rtol=0)
    assert_caches_equal(chunk_cache, one_cache)
    # and the continuation is the same
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    token = engine.new_request(ids, params).sample(one_logits)
    a = engine.forward([([token], one_cache)])[0]
    b = engine.forward([([token], chunk_cache)])[0]
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_all_logits_of_chunks_equal_one_shot(kind: str, load_engine: Any) -> None:
    engine = load_engine(kind)
    ids = prompt(engine)
    full = engine.forward_all([(ids, engine.new_cache())])[0]
    cache = engine.new_cache()
    parts = [engine.forward_all([(ids[i : i + 5], cache)])[0] for i in range(0, len(ids), 5)]
    np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-4, rtol=0)


def test_sliding_layers_keep_only_the_window(load_engine: Any) -> None:
    engine = load_engine("hybrid")
    windows = engine.config.layer_windows
    assert windows == (8, None, 8, None)
    cache = engine.new_cache()
    ids = prompt(engine, 20)
    for n, token in enumerate(ids, start=1):
        engine.forward([([token], cache)])
        for layer, (k, v) in enumerate(cache.layers()):
            expected = n if windows[layer] is None else min(n, 8)
            assert k.shape == v.shape == (engine.config.num_kv_heads, expected, engine.config.head_dim)
    assert cache.position == 20
    per_token = 2 * engine.config.num_kv_heads * engine.config.head_dim * 4
    assert cache.nbytes() == (8 + 20 + 8 + 20) * per_token


def test_sliding_window_changes_the_output(load_engine: Any, make_checkpoint: Any) -> None:
    """Guard for the parity test: the hybrid model really depends on its window beyond 8 tokens."""
    engine = load_engine("hybrid")
    ids = prompt(engine, 20)
    windowed = engine.forward_all([(ids, engine.new_cache())])[0]
    no_window = Engine.load(make_checkpoint("hybrid", overrides={"use_sliding_window": False}))
    assert no_window.config.layer_windows == (None, None, None, None)
    full = no_window.forward_all([(ids, no_window.new_cache())])[0]
    np.testing.assert_allclose(windowed[:8], full[:8], atol=1e-4, rtol=0)
    assert np.abs(windowed[8:] - full[8:]).max() > 1e-2


def test_batched_step_equals_separate_steps(kind: str, load_engine: Any) -> None:
    """A step mixing a fresh prefill, a prefill continuation and decode tokens equals running each alone."""
    engine = load_engine(kind)
    ids = prompt(engine)
    seqs = [ids[:9], ids[3:15], ids[5:6], ids[:20]]
    solo_caches = []
    for s in seqs:
        _, c = engine.prefill(s)
        solo_caches.append(c)
    batch_caches = [c.copy() for c in solo_caches]
    new_tokens = [[ids[9]], ids[15:19], [ids[6]], [ids[20]]]
    new_tokens.append(ids[:11])  # a brand-new sequence joining the batch
    solo_caches.append(engine.new_cache())
    batch_caches.append(engine.new_cache())
    batched = engine.forward(list(zip(new_tokens, batch_caches, strict=True)))
    for i, (toks, cache) in enumerate(zip(new_tokens, solo_caches, strict=True)):
        solo = engine.forward([(toks, cache)])[0]
        np.testing.assert_allclose(batched[i], solo, atol=1e-4, rtol=0)
        assert_caches_equal(batch_caches[i], cache)


def test_serialised_cache_continues_identically(kind: str, load_engine: Any) -> None:
    """Prefill on one side, ship every layer as bytes, decode on the other: same tokens as colocated."""
    engine = load_engine(kind)
    ids = prompt(engine)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    colocated = engine.generate(ids, params)

    logits, cache = engine.prefill(ids, chunk_size=8)
    shipped = [cache.serialize_layer(i) for i in range(engine.config.num_layers)]
    for layer, blob in enumerate(shipped):
        assert blob.dtype == "float32"
        assert blob.shape == (engine.config.num_kv_heads, cache.layer_tokens(layer), engine.config.head_dim)
    received = KVCache.deserialize(engine.kv_spec, shipped, position=len(ids))
    assert_caches_equal(received, cache, atol=0)
    request = engine.new_request(ids, params)
    out = request.step(logits)
    tokens = [out.token_id]
    while not out.finished:
        out = request.step(engine.forward([([out.token_id], received)])[0])
        tokens.append(out.token_id)
    assert tokens == colocated.token_ids
    assert request.text == colocated.text


def test_from_layers_roundtrip_and_validation(load_engine: Any) -> None:
    engine = load_engine("hybrid")
    _, cache = engine.prefill(prompt(engine, 12))
    rebuilt = engine.cache_from_layers(cache.layers(), cache.position)
    assert_caches_equal(rebuilt, cache, atol=0)
    layers = cache.layers()
    with pytest.raises(KVCacheError, match="layer 0 K has shape"):
        engine.cache_from_layers([(layers[1][0], layers[1][1]), *layers[1:]], 12)
    with pytest.raises(KVCacheError, match="got 3 KV layers"):
        engine.cache_from_layers(layers[:3], 12)
    with pytest.raises(KVCacheError, match="dtype"):
        engine.cache_from_layers([(k.astype(np.float16), v) for k, v in layers], 12)


def test_cache_views_are_read_only(load_engine: Any) -> None:
    engine = load_engine("dense")
    _, cache = engine.prefill(prompt(engine, 5))
    k, _ = cache.layer(0)
    with pytest.raises(ValueError):
        k[0, 0, 0] = 1.0


def test_forward_rejects_bad_batches(load_engine: Any) -> None:
    engine = load_engine("dense")
    other = load_engine("hybrid")
    cache = engine.new_cache()
    with pytest.raises(EngineError, match="at least one"):
        engine.forward([])
    with pytest.raises(EngineError, match="no tokens"):
        engine.forward([([], cache)])
    with pytest.raises(EngineError, match="outside"):
        engine.forward([([engine.config.vocab_size], cache)])
    with pytest.raises(KVCacheError, match="twice"):
        engine.forward([([1], cache), ([2], cache)])
    with pytest.raises(KVCacheError, match="does not belong"):
        engine.forward([([1], other.new_cache())])
    assert cache.position == 0  # nothing was appended by the rejected steps


def test_kv_spec_layer_tokens() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, layer_windows=(None, 4))
    assert [spec.layer_tokens(0, p) for p in (0, 3, 9)] == [0, 3, 9]
    assert [spec.layer_tokens(1, p) for p in (0, 3, 9)] == [0, 3, 4]
    assert dataclasses.is_dataclass(spec)


def test_long_decode_keeps_sliding_buffers_bounded(load_engine: Any) -> None:
    engine = load_engine("hybrid")
    _, cache = engine.prefill(prompt(engine, 4))
    for t in range(60):
        engine.forward([([t % 100 + 10], cache)])
    for layer, window in enumerate(engine.config.layer_windows):
        if window is not None:
            assert cache._k[layer].shape[1] <= 2 * window + 1
