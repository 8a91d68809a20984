"""The local environment's checkpoints (pdstack/local/model.py) speak ordinary words: whatever ids their random
weights pick decode to printable words, prompts outside their vocabulary still encode, and a folder an older pdstack
made with other bytes is replaced."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine import Tokenizer
from pdserve.engine.testmodels import make_test_checkpoint
from pdstack.local.model import MANIFEST, ensure_model, ensure_vllm_model, write_manifest
from tests.local.load import LONG_PROMPT

# Lowercase words, each maybe followed by . , ! or ? marks, separated by single spaces.
WORDS = re.compile(r"[^\W\d_]+[.,!?]*(?: [^\W\d_]+[.,!?]*)*")
MODELS = {"pdserve": ensure_model, "vllm": ensure_vllm_model}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    ensure: Callable[[Path], Path] = MODELS[request.param]
    return Tokenizer.from_directory(ensure(tmp_path_factory.mktemp("models")))


def test_random_token_ids_decode_to_printable_words(tokenizer: Tokenizer) -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        ids = [int(i) for i in rng.integers(0, tokenizer.vocab_size, 24)]
        text = tokenizer.decode(ids).lstrip(".,!? ")  # a sequence may open with punctuation
        assert text.isprintable() and WORDS.fullmatch(text), (ids, text)


def test_every_token_is_a_word_or_a_punctuation_mark(tokenizer: Tokenizer) -> None:
    pieces = {tokenizer.decode([i]) for i in range(tokenizer.vocab_size)} - {""}  # "": <unk>, <s>, </s>
    assert {p for p in pieces if not re.fullmatch(r"[^\W\d_]+|[.,!?]", p)} == set()
    assert len(pieces) == tokenizer.vocab_size - 3


def test_words_outside_the_vocabulary_encode_as_unknown(tokenizer: Tokenizer) -> None:
    unk = tokenizer.special_token_id("unk_token")
    ids = tokenizer.encode(f"{LONG_PROMPT} xylophone 日本 🙂")
    assert unk is not None and ids.count(unk) >= 3
    assert tokenizer.decode(ids).startswith("prefill runs in one datacenter and the decode in the other,")


def test_a_checkpoint_made_otherwise_is_replaced_and_a_current_one_kept(tmp_path: Path) -> None:
    old = make_test_checkpoint("dense", tmp_path / "pdstack-tiny")  # the byte-fallback BPE of earlier releases
    old_manifest = write_manifest(old).read_text()
    model = ensure_model(tmp_path)
    assert (model / MANIFEST).read_text() != old_manifest
    assert json.loads((model / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    inode = (model / MANIFEST).stat().st_ino
    assert ensure_model(tmp_path) == model and (model / MANIFEST).stat().st_ino == inode
    assert [p.name for p in tmp_path.iterdir()] == ["pdstack-tiny"]  # no scratch folder left behind
