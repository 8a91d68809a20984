"""Parity with Hugging Face transformers (torch CPU, float32, eager attention) on the tiny test checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch  # the `parity` extra of serving/pyproject.toml: test-only, never in the serving image
import transformers

from pdserve.engine import Engine, SamplingParams

PROMPTS = (
    "the quick server sends a request to the cache and the cache answers slowly over the network",
    "Hello, world!",
)
GREEDY_TOKENS = 20
TOL = 1e-4


def hf_model(path: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return [int(t) for t in out[0, len(ids) :]]


def check_parity(engine: Engine, path: Path) -> None:
    model = hf_model(path)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ours = engine.forward_all([(ids, engine.new_cache())])[0]
        ref = hf_logits(model, ids)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() < TOL, f"logits differ by {np.abs(ours - ref).max()} on {prompt!r}"
        generated = engine.generate(ids, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
        assert generated.token_ids == hf_greedy(model, ids, GREEDY_TOKENS)


def test_parity_float32(kind: str, make_checkpoint: Any, load_engine: Any) -> None:
    check_parity(load_engine(kind), make_checkpoint(kind))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("model_kind", ["dense", "hybrid"])
def test_parity_half_precision_storage(model_kind: str, dtype: str, make_checkpoint: Any, load_engine: Any) -> None:
    engine = load_engine(model_kind, dtype)
    assert engine.dtype == dtype
    check_parity(engine, make_checkpoint(model_kind, dtype))


ROPE_VARIANTS = {
    "default": {"rope_scaling": None, "rope_theta": 500000.0},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    "legacy-type-key": {"rope_scaling": {"type": "linear", "factor": 2.0}},
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_parity_rope_variants(variant: str, make_checkpoint: Any) -> None:
    path = make_checkpoint("dense", overrides=ROPE_VARIANTS[variant])
    check_parity(Engine.load(path), path)


def test_parity_sharded_mistral_sliding(make_checkpoint: Any) -> None:
    """Mistral config (every layer slides), weights split over two safetensors shards."""
    path = make_checkpoint(
        "dense",
        shards=2,
        overrides={
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 6,
            "rope_scaling": None,
        },
    )
    engine = Engine.load(path)
    assert engine.config.layer_windows == (6, 6, 6)
    check_parity(engine, path)


def test_parity_llama_biases_and_tied_embeddings(make_checkpoint: Any) -> None:
    path = make_checkpoint("dense", overrides={"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True})
    check_parity(Engine.load(path), path)


def test_parity_decode_steps_after_chunked_prefill(kind: str, make_checkpoint: Any, load_engine: Any) -> None:
    """Logits of every decode step (after a chunked prefill) match a full-sequence transformers forward."""
    engine = load_engine(kind)
    model = hf_model(make_checkpoint(kind))
    ids = engine.tokenizer.encode(PROMPTS[0])
    _, cache = engine.prefill(ids[:13], chunk_size=5)
    seq = list(ids[:13])
    for token in ids[13:]:
        seq.append(token)
        ours = engine.forward([([token], cache)])[0]
        assert np.abs(ours - hf_logits(model, seq)[-1]).max() < TOL


CONVERSATIONS = (
    [{"role": "user", "content": "hi there"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is a cache?"},
        {"role": "assistant", "content": "a store."},
        {"role": "user", "content": "café 日本 🙂?"},
    ],
)
TEXTS = ("Hello, world!", "  spaced   out  ", "héllo 日本語 🙂 über", "the cache\nwindow")


def assert_same_chat_template(engine: Engine, tok: Any) -> None:
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert (
                engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
            )
            expected_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
            if not isinstance(expected_ids, list):
                expected_ids = expected_ids["input_ids"]
            assert engine.chat_prompt(messages, add_generation_prompt=add_generation_prompt) == list(expected_ids)


def assert_same_tokens(engine: Engine, tok: Any, texts: tuple[str, ...] = TEXTS) -> None:
    for text in texts:
        ids = engine.tokenizer.encode(text)
        assert ids == tok(text)["input_ids"]
        assert engine.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(kind: str, make_checkpoint: Any, load_engine: Any) -> None:
    assert_same_chat_template(load_engine(kind), transformers.AutoTokenizer.from_pretrained(str(make_checkpoint(kind))))


def test_tokenizer_matches_transformers(kind: str, make_checkpoint: Any, load_engine: Any) -> None:
    assert_same_tokens(load_engine(kind), transformers.AutoTokenizer.from_pretrained(str(make_checkpoint(kind))))


def test_word_level_tokenizer_matches_transformers(make_checkpoint: Any, load_engine: Any) -> None:
    """The local environment's vocabulary (pdstack/local/model.py): the same ids, text and chats both ways, words
    outside it included, and any ids decode to the same words."""
    engine = load_engine("dense", tokenizer="words")
    tok = transformers.AutoTokenizer.from_pretrained(str(make_checkpoint("dense", tokenizer="words")))
    assert_same_tokens(engine, tok, (*TEXTS, *PROMPTS, "Prefill in one datacenter, decode in the other: KV!"))
    assert_same_chat_template(engine, tok)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, engine.tokenizer.vocab_size, 200)]
    assert engine.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)
