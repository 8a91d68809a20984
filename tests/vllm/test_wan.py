"""PdstackConnector across the emulated WAN: a vLLM prefill and a vLLM decode in two network namespaces joined by
pdstack's WAN link (1 Gbit/s, 20 ms RTT), the KV crossing it and nothing else (HTTP reaches each side over an
unshaped veth pair). Decode runs with kv_load_failure_policy `fail`, so an answer equal to colocated cannot come
from a silent local recompute. The pair serves the long-context llama, for ~4K-token prompts (16 MB of KV each):
completions and chat, whole and streamed. Needs root, /dev/net/tun and iproute2 (CI runs as root;
scripts/host-setup.sh).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.vllm_ttft import measure_point
from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.kv.auth import SecretKey
from pdstack.local.wan import LinkShape
from tests.vllm.conftest import (
    BLOCK_SIZE,
    DO_REMOTE_DECODE,
    LONG_MODEL_CONFIG,
    MAX_TOKENS,
    MODEL_CONFIG,
    Pair,
    VLLMServer,
    WanSites,
    loaded,
    prompt_of,
    start_pair,
    token_ids,
)

RATE_MBIT, RTT_MS = 1000.0, 20.0
RECEIVED = ("pdserve_kv_transfer_bytes_total", 'role="receiver"')
LONG_PROMPT = 4000  # ~4K tokens: 125 blocks, the last one partly filled
# What crosses the link beyond the KV payload: the channel's frames and digests, TCP/IP headers (about 3 % at a
# 1500-byte MTU), retransmissions when the link's queue overflows. Measured here at load 16-30: 1.01-1.11 times
# the KV. The bound tells "the KV crossed once" from "it crossed twice" (a pull repeated) or "other traffic did".
LINK_OVERHEAD = 0.5


@pytest.fixture(scope="module")
def wan() -> Iterator[WanSites]:
    with WanSites(LinkShape(RATE_MBIT, RTT_MS)) as sites:
        yield sites


@pytest.fixture(scope="module")
def wan_pair(
    wan: WanSites, model_dir: Path, kv_key_file: Path, kv_key: SecretKey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    # The long-context llama, so ~4K-token prompts fit (the same tiny model with max_position_embeddings 16384).
    long_model = make_test_checkpoint(
        "dense", tmp_path_factory.mktemp("llama-long"), "float32", overrides=LONG_MODEL_CONFIG, vocab_size=512
    )
    yield from start_pair(
        long_model, kv_key_file, kv_key, tmp_path_factory, "fail", sites=wan.sites, max_model_len=LONG_PROMPT + 512
    )


def test_kv_crosses_the_wan_and_output_equals_colocated(wan: WanSites, wan_pair: Pair) -> None:
    prompt = prompt_of(30 * BLOCK_SIZE + 5, seed=31)
    colocated = token_ids(wan_pair.prefill.complete(prompt, MAX_TOKENS))
    received_before = wan_pair.decode.metric(*RECEIVED)
    link_before = wan.link_bytes()

    params = wan_pair.prefill_params(prompt)
    assert (params["remote_host"], params["remote_port"]) == (wan.sites[0].kv_host, wan_pair.kv_port)
    answer = wan_pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)

    assert token_ids(answer) == colocated
    assert loaded(wan_pair, params["remote_request_id"]), wan_pair.decode.log_tail()
    kv_bytes = wan_pair.decode.wait_metric(RECEIVED[0], lambda v: v > received_before, RECEIVED[1]) - received_before
    layers, kv_heads, head_dim = (MODEL_CONFIG[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
    assert kv_bytes == len(params["remote_block_ids"]) * layers * kv_heads * BLOCK_SIZE * 2 * head_dim * 4
    moved = wan.link_bytes()
    assert moved["prefill_to_decode"] - link_before["prefill_to_decode"] >= kv_bytes
    assert moved["decode_to_prefill"] > link_before["decode_to_prefill"]  # decode's requests and ACKs


def test_ttft_bench_measures_a_point_over_the_wan(wan: WanSites, wan_pair: Pair) -> None:
    """bench/vllm_ttft.py's code path at a tiny size: its figures are those of a KV that crossed the link."""
    point = measure_point(wan_pair, wan, length=2 * BLOCK_SIZE, repeats=1, flows=("proxy",))
    proxy = point["flows"]["proxy"]
    median = proxy["median"]
    assert median["kv_bytes"] > 0 and median["link_bytes"] >= median["kv_bytes"]
    # The decode's first token came after prefill answered and at least one RTT of pulling over the link.
    assert median["ttft_s"] > median["prefill_leg_s"] + RTT_MS / 1000
    assert proxy["bound_s"] >= point["colocated_ttft_s"] + RTT_MS / 1000


def complete_stream(server: VLLMServer, prompt: list[int], max_tokens: int, **extra: Any) -> list[int]:
    """The token ids of a streamed completion, joined from its SSE chunks (return_token_ids: each has its delta)."""
    body = {
        "model": str(server.model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    ids: list[int] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    ids.extend(choice.get("token_ids") or [])
    return ids


def long_messages(seed: int) -> list[dict[str, str]]:
    """A user message of about LONG_PROMPT tokens (the test tokenizer, trained on other text, cuts each of these
    words into about 4 tokens)."""
    rng = random.Random(seed)
    words = ["river", "road", "city", "bridge", "north", "sea", "valley", "station", "market", "harbour", "hill"]
    return [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(LONG_PROMPT // 4))}]


def completion(pair: Pair, prompt: list[int], stream: bool) -> tuple[list[int], dict[str, Any], list[int]]:
    """(colocated token ids, the params prefill issued, the token ids decode answered with them)."""
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS, timeout=300))
    params = pair.prefill_params(prompt)
    if stream:
        answer = complete_stream(pair.decode, prompt, MAX_TOKENS, kv_transfer_params=params)
    else:
        answer = token_ids(pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params, timeout=300))
    return colocated, params, answer


def chat(pair: Pair, messages: list[dict[str, str]], stream: bool) -> tuple[str, dict[str, Any], str]:
    colocated = pair.prefill.chat(messages, MAX_TOKENS, ignore_eos=True)
    assert abs(colocated["usage"]["prompt_tokens"] - LONG_PROMPT) < LONG_PROMPT // 4, colocated["usage"]
    params = pair.prefill.chat(messages, 1, kv_transfer_params=DO_REMOTE_DECODE)["kv_transfer_params"]
    if stream:
        answer = pair.decode.chat_stream(messages, MAX_TOKENS, kv_transfer_params=params, ignore_eos=True)
    else:
        reply = pair.decode.chat(messages, MAX_TOKENS, kv_transfer_params=params, ignore_eos=True)
        answer = reply["choices"][0]["message"]["content"]
    return colocated["choices"][0]["message"]["content"], params, answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_long_prompt_over_the_wan_equals_colocated(wan: WanSites, wan_pair: Pair, api: str, stream: bool) -> None:
    """A ~4K-token prompt (16 MB of KV) crosses the link: decode (policy fail: no silent recompute) answers
    colocated greedy output, and the link carried the KV, about its size and no less."""
    received_before = wan_pair.decode.metric(*RECEIVED)
    link_before = wan.link_bytes()
    seed = 32 + 2 * (api == "chat") + stream  # a prompt of its own: no prefix of it is in decode's cache
    if api == "completions":
        colocated, params, answer = completion(wan_pair, prompt_of(LONG_PROMPT, seed=seed), stream)
        assert params["num_tokens"] == LONG_PROMPT
    else:
        colocated, params, answer = chat(wan_pair, long_messages(seed=seed), stream)
    moved = wan.link_bytes()

    assert answer == colocated and len(colocated) > 0
    assert loaded(wan_pair, params["remote_request_id"]), wan_pair.decode.log_tail()
    layers, kv_heads, head_dim = (MODEL_CONFIG[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
    kv_bytes = len(params["remote_block_ids"]) * layers * kv_heads * BLOCK_SIZE * 2 * head_dim * 4
    wan_pair.decode.wait_metric(RECEIVED[0], lambda v: v - received_before == kv_bytes, RECEIVED[1])
    crossed = moved["prefill_to_decode"] - link_before["prefill_to_decode"]
    print(f"{api} stream={stream}: KV {kv_bytes} bytes, link carried {crossed} ({crossed / kv_bytes:.4f}x)")
    assert kv_bytes <= crossed <= kv_bytes * (1 + LINK_OVERHEAD)
