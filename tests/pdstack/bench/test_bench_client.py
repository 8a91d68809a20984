"""How one streamed request is measured, and how each way of failing is named.

Answers come from httpx.MockTransport (in process) so each failure is exact; connection refusal and a server that
never answers use real loopback sockets.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from pdstack.bench.client import (
    CONNECTION,
    EMPTY_ANSWER,
    HTTP_4XX,
    HTTP_5XX,
    HTTP_429,
    PROTOCOL,
    STREAM_ERROR,
    TIMEOUT,
    RequestResult,
    chunk_text,
    request_body,
    send_request,
)
from pdstack.bench.endpoint import Endpoint

CHAT = Endpoint("http://127.0.0.1:1/v1", "chat", "tiny", api_key="sk-test-key")
COMPLETIONS = Endpoint("http://127.0.0.1:1/v1", "completions", "tiny")


def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chat_chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}


def measure(
    handler: Callable[[httpx.Request], Any], endpoint: Endpoint = CHAT, timeout_s: float = 5.0
) -> RequestResult:
    async def go() -> RequestResult:
        async with httpx.AsyncClient(base_url=endpoint.base_url, transport=httpx.MockTransport(handler)) as client:
            body = request_body(endpoint, "hello there", max_tokens=3, ignore_eos=False)
            return await send_request(client, endpoint, body, RequestResult(0, 0.0, 0.0, "short"), timeout_s)

    return asyncio.run(go())


def test_a_streamed_chat_answer_is_timed_and_counted_from_usage() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        role_only = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        return httpx.Response(
            200, content=sse(role_only, chat_chunk("a"), chat_chunk(" b"), chat_chunk(" c"), USAGE, "[DONE]")
        )

    result = measure(handler)
    assert result.ok, result.detail
    assert result.prompt_tokens == 12 and result.completion_tokens == 3
    assert result.content_chunks == 3
    assert result.ttft_s is not None and result.e2e_s is not None and 0 < result.ttft_s <= result.e2e_s
    request = seen[0]
    assert request.url.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test-key"
    body = json.loads(request.content)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hello there"}]


def test_completions_api_sends_a_prompt_and_reads_text() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        assert json.loads(request.content)["prompt"] == "hello there"
        return httpx.Response(200, content=sse({"choices": [{"text": "x"}]}, {"choices": [{"text": "y"}]}, "[DONE]"))

    result = measure(handler, COMPLETIONS)
    assert result.ok
    assert result.completion_tokens is None and result.output_tokens == 2  # no usage: counted from chunks


def test_chunk_text_reads_both_stream_shapes() -> None:
    assert chunk_text(chat_chunk("hi")) == "hi"
    assert chunk_text({"choices": [{"text": "yo"}]}) == "yo"
    assert chunk_text(USAGE) == ""
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""


@pytest.mark.parametrize(
    ("status", "cause"), [(429, HTTP_429), (400, HTTP_4XX), (401, HTTP_4XX), (500, HTTP_5XX), (503, HTTP_5XX)]
)
def test_http_status_classes(status: int, cause: str) -> None:
    result = measure(lambda _: httpx.Response(status, json={"error": {"message": "no"}}))
    assert result.error == cause
    assert result.detail is not None and result.detail.startswith(f"HTTP {status}")


def test_an_error_event_inside_the_stream() -> None:
    error = {"error": {"message": "engine failed", "type": "server_error", "code": 500}}
    result = measure(lambda _: httpx.Response(200, content=sse(chat_chunk("a"), error, "[DONE]")))
    assert result.error == STREAM_ERROR
    assert "engine failed" in (result.detail or "")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (sse(chat_chunk("a")), "without [DONE]"),
        (b"data: {not json\n\n", "not JSON"),
        (sse(USAGE, "[DONE]"), "no generated text"),
    ],
)
def test_malformed_streams_are_protocol_errors(body: bytes, why: str) -> None:
    result = measure(lambda _: httpx.Response(200, content=body))
    assert result.error == PROTOCOL
    assert why in (result.detail or "")


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_whole_answer_without_text_is_named_apart_from_protocol_errors(reason: str) -> None:
    """A greedy EOS first (stop), or tokens that render as no text (length, with ignore_eos): the model's answer,
    not a broken stream; an empty stream that says nothing of how it ended stays a protocol error (above), and so
    does one the engine gave up (abort)."""
    end = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": reason}]}
    result = measure(lambda _: httpx.Response(200, content=sse(chat_chunk(""), end, USAGE, "[DONE]")))
    assert result.error == EMPTY_ANSWER, result.detail
    assert f"finish_reason {reason}, 3 completion tokens" in (result.detail or "")
    aborted = {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}
    assert measure(lambda _: httpx.Response(200, content=sse(aborted, "[DONE]"))).error == PROTOCOL


def test_a_dropped_connection_mid_stream() -> None:
    async def dropping() -> AsyncIterator[bytes]:
        yield sse(chat_chunk("a"))
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    result = measure(lambda _: httpx.Response(200, content=dropping()))
    assert result.error == CONNECTION


def test_connection_refused_on_a_closed_loopback_port() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "chat", "tiny")

        async def go() -> RequestResult:
            async with httpx.AsyncClient(base_url=endpoint.base_url) as client:
                body = request_body(endpoint, "hi", 3, False)
                return await send_request(client, endpoint, body, RequestResult(0, 0.0, 0.0, "short"), 5.0)

        result = asyncio.run(go())
    assert result.error == CONNECTION


def test_a_server_that_never_answers_is_a_timeout() -> None:
    async def go() -> RequestResult:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(65536)
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", "chat", "tiny")
        async with server, httpx.AsyncClient(base_url=endpoint.base_url) as client:
            body = request_body(endpoint, "hi", 3, False)
            return await send_request(client, endpoint, body, RequestResult(0, 0.0, 0.0, "short"), timeout_s=0.3)

    result = asyncio.run(go())
    assert result.error == TIMEOUT
    assert result.e2e_s is None


def test_the_api_key_never_appears_in_the_endpoint_repr() -> None:
    assert "sk-test-key" not in repr(CHAT)
