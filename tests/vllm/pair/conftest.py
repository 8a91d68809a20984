"""One prefill/decode pair that every module of this package shares (started once, stopped when the package's last
test is done): the llama with a long context, room for test_models' ~4K-token prompt, and chunked prefill of
BATCHED_TOKENS a step, which test_layerwise's streaming needs. Each module uses prompts (seeds) of its own, so no
module finds its prompts in a prefix cache another one filled."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.kv.auth import SecretKey
from tests.vllm.conftest import LONG_MODEL_CONFIG, Pair, start_pair

LONG_PROMPT = 4000  # ~4K tokens: 125 blocks, the last one partly filled
BATCHED_TOKENS = 128  # four blocks a prefill step


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_checkpoint(
        "dense", tmp_path_factory.mktemp("llama-long"), "float32", overrides=LONG_MODEL_CONFIG, vocab_size=512
    )


@pytest.fixture(scope="package")
def pair(
    long_model_dir: Path, kv_key_file: Path, kv_key: SecretKey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    yield from start_pair(
        long_model_dir,
        kv_key_file,
        kv_key,
        tmp_path_factory,
        "recompute",
        max_model_len=LONG_PROMPT + 512,
        batched_tokens=BATCHED_TOKENS,
    )
