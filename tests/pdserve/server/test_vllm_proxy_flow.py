"""vLLM's disaggregated proxy flow (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) drives pdserve.

The proxy below does what vLLM's toy proxy does, step for step: copy the request, set the six kv_transfer_params
fields, stream=false, max_tokens=1 (and max_completion_tokens=1 if present), drop stream_options, min_tokens and
min_completion_tokens, POST to prefill with an X-Request-Id, then send decode the original request plus the
kv_transfer_params prefill answered (min_tokens and min_completion_tokens put back as they were, None when absent), and
stream decode's bytes through. Nothing in it knows about pdserve.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.support.ports import free_port
from tests.support.serverproc import API_TOKEN, metric_value

from .conftest import Deployment


def vllm_toy_proxy(prefill_url: str, decode_url: str) -> Starlette:
    async def handle(request: Request) -> StreamingResponse:
        api = request.url.path.removeprefix("/v1")
        req_data: dict[str, Any] = await request.json()
        request_id = str(uuid.uuid4())
        prefill_data = req_data.copy()
        prefill_data["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        prefill_data["stream"] = False
        prefill_data["max_tokens"] = 1
        if "max_completion_tokens" in prefill_data:
            prefill_data["max_completion_tokens"] = 1
        prefill_data.pop("stream_options", None)
        min_tokens = prefill_data.pop("min_tokens", None)
        min_completion_tokens = prefill_data.pop("min_completion_tokens", None)
        headers = {"Authorization": f"Bearer {API_TOKEN}", "X-Request-Id": request_id}  # vLLM's: OPENAI_API_KEY
        async with httpx.AsyncClient(base_url=prefill_url + "/v1", timeout=None) as client:
            response = await client.post(api, json=prefill_data, headers=headers)
            response.raise_for_status()
        prefill_data["min_tokens"] = min_tokens
        prefill_data["min_completion_tokens"] = min_completion_tokens
        kv_transfer_params = response.json().get("kv_transfer_params", {})
        if kv_transfer_params:
            req_data["kv_transfer_params"] = kv_transfer_params

        async def stream() -> AsyncIterator[bytes]:
            async with (
                httpx.AsyncClient(base_url=decode_url + "/v1", timeout=None) as client,
                client.stream("POST", api, json=req_data, headers=headers) as decoded,
            ):
                decoded.raise_for_status()
                async for chunk in decoded.aiter_bytes():
                    yield chunk

        return StreamingResponse(stream(), media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/completions", handle, methods=["POST"]),
            Route("/v1/chat/completions", handle, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def proxy_url(dense: Deployment) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            vllm_toy_proxy(dense.prefill.url, dense.decode.url), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the vLLM proxy did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_vllm_proxy_drives_completions(dense: Deployment, proxy_url: str) -> None:
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=API_TOKEN)
    colocated = openai.OpenAI(base_url=dense.colocated.url + "/v1", api_key=API_TOKEN)
    model = colocated.models.list().data[0].id
    args: dict[str, Any] = {
        "model": model,
        "prompt": "the proxy sends prefill one token",
        "max_tokens": 12,
        "temperature": 0,
    }
    expected = colocated.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == expected
    streamed = client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected


def test_vllm_proxy_drives_chat_with_min_tokens(dense: Deployment, proxy_url: str) -> None:
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=API_TOKEN)
    colocated = openai.OpenAI(base_url=dense.colocated.url + "/v1", api_key=API_TOKEN)
    model = colocated.models.list().data[0].id
    args: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_completion_tokens": 9,
        "temperature": 0,
    }
    expected = colocated.chat.completions.create(**args).choices[0].message.content
    pulled_before = metric_value(dense.decode.metrics(), "pdserve_kv_transfer_bytes_total", {"role": "receiver"})
    answer = client.chat.completions.create(**args, extra_body={"min_tokens": 0})
    assert answer.choices[0].message.content == expected
    pulled = metric_value(dense.decode.metrics(), "pdserve_kv_transfer_bytes_total", {"role": "receiver"})
    assert pulled > pulled_before  # decode really took the KV from prefill
