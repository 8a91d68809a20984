from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from tests.pdserve.engine.conftest import KINDS

SAMPLES = (
    "Hello, world! café naïve",
    "日本語のテキスト 🙂🚀 mixed with ascii",
    "  leading and   multiple spaces\nnew line\ttab",
    "über résumé façade — em dash … ellipsis",
)


def stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.fixture(params=[*KINDS, "dense+words"])
def any_tokenizer(request: pytest.FixtureRequest, load_engine: Any) -> Tokenizer:
    """Each kind's own tokenizer, and the word-level one of the local environment's models."""
    kind, _, name = str(request.param).partition("+")
    return load_engine(kind, **({"tokenizer": name} if name else {})).tokenizer


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_detokenisation_matches_full_decode(any_tokenizer: Tokenizer, text: str) -> None:
    tok = any_tokenizer
    prompt = tok.encode("prompt text:")
    ids = tok.encode(" " + text, add_special_tokens=False)
    deltas = stream(tok, prompt, ids)
    assert all("\ufffd" not in d for d in deltas)
    full = tok.decode(prompt + ids)
    assert full.startswith(tok.decode(prompt))
    assert "".join(deltas) == full[len(tok.decode(prompt)) :]


def test_byte_fallback_pieces_are_held_until_complete(load_engine: Any) -> None:
    tok = load_engine("dense").tokenizer
    ids = tok.encode("日", add_special_tokens=False)
    byte_pieces = [tok.backend.id_to_token(i) for i in ids]
    assert byte_pieces[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    deltas = stream(tok, tok.encode("x"), ids)
    assert deltas[-4:] == ["", "", "日", ""]  # the three byte pieces, then the final flush
    assert "".join(deltas) == " 日"


def test_random_texts_stream_exactly(any_tokenizer: Tokenizer) -> None:
    tok = any_tokenizer
    pieces = ["the", "cache", " ", "  ", "é", "日本", "🙂", "\n", "server", "über", ",", "!", "x", "—", "ß"]
    rnd = random.Random(0)
    prompt = tok.encode("ok")
    base = tok.decode(prompt)
    for _ in range(40):
        text = " " + "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 12)))
        ids = tok.encode(text, add_special_tokens=False)
        deltas = stream(tok, prompt, ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == tok.decode(prompt + ids)[len(base) :]


def test_invalid_utf8_is_flushed_at_the_end(load_engine: Any) -> None:
    tok = load_engine("dense").tokenizer
    lone = tok.token_to_id("<0xE6>")
    assert lone is not None
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.push(lone) == ""
    assert detok.flush() == "\ufffd"


def test_chat_template_renders_without_transformers(load_engine: Any) -> None:
    tok = load_engine("dense").tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<s><<SYS>>\nS\n<</SYS>>\n\n[INST] U [/INST]"
    ids = tok.encode_chat([{"role": "user", "content": "U"}])
    assert ids[0] == tok.special_token_id("bos_token")
    assert ids.count(tok.special_token_id("bos_token")) == 1  # from the template only
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])


def test_chatml_generation_prompt(load_engine: Any) -> None:
    tok = load_engine("hybrid").tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": " hi "}], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.token_to_id("<|im_start|>") in ids


def test_chat_template_file_and_named_templates(tmp_path: Path, dense_checkpoint: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((dense_checkpoint / name).read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_directory(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}{{ messages[0] | tojson }}")
    rendered = Tokenizer.from_directory(tmp_path).apply_chat_template([{"role": "user", "content": "é"}])
    assert rendered == 'J1{"role": "user", "content": "é"}'
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        Tokenizer.from_directory(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_generation_tag_is_accepted(tmp_path: Path, dense_checkpoint: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((dense_checkpoint / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}"
        "{% else %}U:{{ m.content }}{% endif %}{% endfor %}"
    )
    tok = Tokenizer.from_directory(tmp_path)
    assert (
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == "U:aA:b"
    )
