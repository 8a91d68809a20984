"""Prefill -> decode output equals colocated output equals transformers' greedy output, per test architecture."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.pdserve.engine.test_parity import hf_greedy, hf_model
from tests.support.serverproc import AUTH, prefill

from .conftest import KINDS, Deployment

PROMPTS = (
    "the quick server sends a request to the cache and the cache answers slowly over the network",
    "Hello!",
)
NEW_TOKENS = 12


@cache
def reference_model(path: Path) -> Any:
    return hf_model(path)


def completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + "/v1/completions", headers=AUTH, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0])


def pd_completion(deployment: Deployment, body: dict[str, Any]) -> dict[str, Any]:
    params = prefill(deployment.prefill.url, body)
    return completion(deployment.decode.url, {**body, "kv_transfer_params": params})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_pd_equals_colocated_equals_transformers(kind: str, prompt: str, deployments: dict[str, Deployment]) -> None:
    deployment = deployments[kind]
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    colocated = completion(deployment.colocated.url, body)
    disaggregated = pd_completion(deployment, body)
    expected = hf_greedy(reference_model(deployment.model), colocated["prompt_token_ids"], NEW_TOKENS)
    assert colocated["token_ids"] == expected
    assert disaggregated["token_ids"] == expected
    assert disaggregated["text"] == colocated["text"]


@pytest.mark.parametrize("kind", KINDS)
def test_chat_through_pd_equals_colocated(kind: str, deployments: dict[str, Deployment]) -> None:
    deployment = deployments[kind]
    body = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a cache?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    chat = "/v1/chat/completions"
    colocated = httpx.post(deployment.colocated.url + chat, headers=AUTH, json=body, timeout=60).json()
    params = prefill(deployment.prefill.url, body, chat)
    decoded = httpx.post(
        deployment.decode.url + chat, headers=AUTH, json={**body, "kv_transfer_params": params}, timeout=60
    ).json()
    assert decoded["choices"][0]["message"] == colocated["choices"][0]["message"]
    assert decoded["usage"] == colocated["usage"]


def test_seeded_sampling_through_pd_equals_colocated(dense: Deployment) -> None:
    """Decode draws every token with the request's own seeded sampler, so even sampled output matches."""
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 10,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 7,
        "return_token_ids": True,
    }
    assert pd_completion(dense, body)["token_ids"] == completion(dense.colocated.url, body)["token_ids"]


def test_prefill_response_carries_vllm_and_pdstack_fields(dense: Deployment) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    params = prefill(dense.prefill.url, body)
    info = dense.prefill.ready_info()
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == info["engine_id"]
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == info["kv_port"]
    assert isinstance(params["remote_request_id"], str) and isinstance(params["remote_block_ids"], list)
    assert params["kv_fingerprint"] == info["fingerprint"]
    assert params["num_tokens"] == len(completion(dense.colocated.url, body)["prompt_token_ids"])
    assert str(params["kv_checksum"]).startswith("sha256:")


def test_prefill_ending_on_a_stop_token_returns_no_kv_params(dense: Deployment) -> None:
    """As vLLM: kv_transfer_params only when the request ended at its length cap; the KV is then freed."""
    body = {"prompt": PROMPTS[0], "temperature": 0, "return_token_ids": True, "max_tokens": 1}
    first = completion(dense.colocated.url, body)["token_ids"][0]
    request = {**body, "stop_token_ids": [first], "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    answer = httpx.post(dense.prefill.url + "/v1/completions", headers=AUTH, json=request, timeout=60).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["kv_transfer_params"] is None


def test_chunked_prefill_gives_the_same_tokens(dense: Deployment, spawn: Any) -> None:
    """A 16-token step budget feeds the prompt in several chunks beside other work; the output must not change."""
    chunked = spawn("colocated", dense.model, "--prefill-token-budget", "16")
    body = {"prompt": PROMPTS[0] * 3, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    reference = completion(dense.colocated.url, body)
    assert len(reference["prompt_token_ids"]) > 3 * 16
    assert completion(chunked.url, body)["token_ids"] == reference["token_ids"]


def test_decode_reports_where_the_kv_came_from(dense: Deployment) -> None:
    """The gateway relays these figures into its KV metrics: bytes and seconds of the pull, or a local prefill."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    params = prefill(dense.prefill.url, body)
    remote = httpx.post(
        dense.decode.url + "/v1/completions", headers=AUTH, json={**body, "kv_transfer_params": params}, timeout=120
    ).json()["kv_transfer_stats"]
    assert remote["source"] == "remote" and remote["bytes"] > 0 and remote["seconds"] > 0
    url = dense.decode.url + "/v1/completions"
    local = httpx.post(url, headers=AUTH, json=body, timeout=120).json()["kv_transfer_stats"]
    assert local == {"source": "local", "bytes": 0, "seconds": 0.0}
    streamed = httpx.post(url, headers=AUTH, json={**body, "stream": True}, timeout=120).text
    assert '"kv_transfer_stats": {"source": "local"' in streamed
    colocated = httpx.post(dense.colocated.url + "/v1/completions", headers=AUTH, json=body, timeout=120).json()
    assert "kv_transfer_stats" not in colocated
