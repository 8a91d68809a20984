"""vllm-router in `--vllm-pd-disaggregation` mode in front of pdserve prefill and decode, unchanged: its two-stage
flow (prefill with max_tokens=1 and the six kv_transfer_params fields, then decode with what prefill returned) gives
the same greedy output as pdserve colocated on the same checkpoint. The servers require their API token; vllm-router
presents it from OPENAI_API_KEY."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.serverproc import API_TOKEN, ServerProcess, start_all
from tests.support.services import Service

from .routers import vllm_router

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def router(bench_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    work = tmp_path_factory.mktemp("vllm-router")
    key = work / "kv.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    servers = start_all(
        [
            ServerProcess(
                "prefill", bench_model, ["--kv-key-file", str(key), "--kv-port", "0"], {}, work / "prefill.log"
            ),
            ServerProcess("decode", bench_model, ["--kv-key-file", str(key)], {}, work / "decode.log"),
        ]
    )
    front = vllm_router([servers[0].url], [servers[1].url], API_TOKEN, work / "vllm-router.log")
    try:
        yield front.start("/health", timeout=120)
    finally:
        front.stop()
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def model(colocated: ServerProcess) -> str:
    return str(httpx.get(f"{colocated.url}/v1/models").json()["data"][0]["id"])


def complete(url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}{endpoint}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_through_vllm_router_equal_colocated(
    router: Service, colocated: ServerProcess, model: str, prompt: str
) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    routed = complete(router.url, "/v1/completions", body)
    local = complete(colocated.url, "/v1/completions", body)
    assert routed["choices"][0]["text"] == local["choices"][0]["text"]
    assert routed["usage"]["completion_tokens"] == local["usage"]["completion_tokens"] == 12
    assert routed["kv_transfer_stats"]["source"] == "remote"  # decode pulled prefill's KV, it did not recompute


def test_chat_through_vllm_router_equals_colocated(router: Service, colocated: ServerProcess, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    routed = complete(router.url, "/v1/chat/completions", body)
    local = complete(colocated.url, "/v1/chat/completions", body)
    assert routed["choices"][0]["message"]["content"] == local["choices"][0]["message"]["content"]


def test_streaming_through_vllm_router_equals_colocated(router: Service, colocated: ServerProcess, model: str) -> None:
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1] if json.loads(event)["choices"])
    local = complete(colocated.url, "/v1/completions", {**body, "stream": False})
    assert streamed == local["choices"][0]["text"]


def test_the_servers_see_the_routers_credential_and_not_the_clients(router: Service, model: str) -> None:
    """A client key sent to vllm-router is not what prefill and decode check: theirs comes from OPENAI_API_KEY."""
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0}
    answer = httpx.post(
        f"{router.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-client"}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    assert API_TOKEN not in router.log_path.read_text()
