"""kv_load_failure_policy "fail": a KV that cannot be had fails the request cleanly instead of recomputing it, and
decode keeps serving; prefill killed before the pull, and prefill restarted (its leases are gone)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.kv.auth import SecretKey
from tests.vllm.conftest import BLOCK_SIZE, MAX_TOKENS, FlippingProxy, Pair, prompt_of, start_pair, token_ids


@pytest.fixture(scope="module")
def pair(
    model_dir: Path, kv_key_file: Path, kv_key: SecretKey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    yield from start_pair(model_dir, kv_key_file, kv_key, tmp_path_factory, "fail")


def decode_raw(pair: Pair, prompt: list[int], params: dict[str, object]) -> httpx.Response:
    body = {
        "model": str(pair.decode.model),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "kv_transfer_params": params,
    }
    return httpx.post(pair.decode.url + "/v1/completions", json=body, timeout=120)


def assert_failed_cleanly(response: httpx.Response) -> None:
    """vLLM 0.32's answer to a request whose KV load failed under "fail": an OpenAI-shaped 500, no tokens."""
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == 500, response.text


def assert_decode_serves(pair: Pair) -> None:
    prompt = prompt_of(33, seed=21)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    answer = pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=pair.prefill_params(prompt))
    assert token_ids(answer) == colocated


def test_flipped_byte_fails_the_request(pair: Pair) -> None:
    prompt = prompt_of(2 * BLOCK_SIZE + 5, seed=20)
    params = pair.prefill_params(prompt)
    with FlippingProxy(pair.kv_port, flip_at=4096) as proxy:
        response = decode_raw(pair, prompt, pair.resign(params, remote_port=proxy.port))
    assert proxy.flipped >= 1
    assert_failed_cleanly(response)
    assert_decode_serves(pair)


def test_prefill_killed_before_the_pull_fails_the_request(pair: Pair) -> None:
    prompt = prompt_of(3 * BLOCK_SIZE, seed=22)
    params = pair.prefill_params(prompt)
    pair.prefill.kill()
    try:
        assert_failed_cleanly(decode_raw(pair, prompt, params))
        assert httpx.get(pair.decode.url + "/health", timeout=5).status_code == 200
    finally:
        pair.prefill.start()  # the same ports: a prefill restarted where it was
        pair.prefill.wait_ready()
    # The restarted prefill holds none of its predecessor's leases: the old params name KV nobody has.
    assert_failed_cleanly(decode_raw(pair, prompt, params))
    assert "not_found" in pair.decode.log().split("left to kv_load_failure_policy")[-1].splitlines()[0]
    assert_decode_serves(pair)
