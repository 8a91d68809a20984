"""One streamed request and what it measured: time to first token, end-to-end time, usage, or why it failed."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from pdstack.bench.endpoint import Endpoint

# error causes, in the order reports list them
OVERLOAD = "overload"  # the max-in-flight cap was hit; the request was never sent
HTTP_429 = "http_429"
HTTP_4XX = "http_4xx"
HTTP_5XX = "http_5xx"
TIMEOUT = "timeout"
CONNECTION = "connection"
STREAM_ERROR = "stream_error"  # the server sent an error event inside the stream
PROTOCOL = "protocol"  # the stream was not what an OpenAI-compatible server sends (bad JSON, no [DONE], no tokens)
# A whole answer without text: the stream ended normally (finish_reason stop or length) but its tokens render as
# nothing (a greedy EOS first, or bytes that form no UTF-8, as a random test checkpoint gives for some prompts; the
# same answer from the engine directly). Not a serving failure, but no TTFT to measure.
EMPTY_ANSWER = "empty_answer"
ERROR_CAUSES = (OVERLOAD, HTTP_429, HTTP_4XX, HTTP_5XX, TIMEOUT, CONNECTION, STREAM_ERROR, PROTOCOL, EMPTY_ANSWER)


@dataclass
class RequestResult:
    """One request: times are seconds; `start_s` is from the run's start, the others from the request's own start."""

    index: int
    scheduled_s: float
    start_s: float
    prompt_kind: str
    first_event_s: float | None = None  # first stream event of any kind (often a role-only chunk)
    ttft_s: float | None = None  # first event carrying generated text
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content_chunks: int = 0
    error: str | None = None
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """Server-reported completion tokens, or the count of content chunks when the server reports no usage."""
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1); undefined for one token."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["tpot_s"] = self.tpot_s
        return record


def request_body(endpoint: Endpoint, prompt: str, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": endpoint.model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if endpoint.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def status_cause(status: int) -> str:
    if status == 429:
        return HTTP_429
    return HTTP_5XX if status >= 500 else HTTP_4XX


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a chat or completions stream chunk carries ("" for usage-only or role-only chunks)."""
    choices = chunk.get("choices") or []
    text = ""
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(piece, str):
            text += piece
    return text


class StreamFailure(Exception):
    """The stream ended in a way that makes the request a failure; `cause` is one of ERROR_CAUSES."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail


def _parse_event(data: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise StreamFailure(PROTOCOL, f"stream event is not JSON: {data[:80]!r}") from exc
    if not isinstance(chunk, dict):
        raise StreamFailure(PROTOCOL, f"stream event is not an object: {data[:80]!r}")
    if "error" in chunk:
        raise StreamFailure(STREAM_ERROR, json.dumps(chunk["error"])[:200])
    return chunk


def _finish_reasons(chunk: dict[str, Any]) -> set[str]:
    choices = chunk.get("choices") or []
    return {c["finish_reason"] for c in choices if isinstance(c, dict) and isinstance(c.get("finish_reason"), str)}


async def _consume_stream(response: httpx.Response, result: RequestResult, started: float) -> None:
    done = False
    finished: set[str] = set()
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments and `event:` lines
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = _parse_event(data)
        finished |= _finish_reasons(chunk)
        if result.first_event_s is None:
            result.first_event_s = time.perf_counter() - started
        if chunk_text(chunk):
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started
            result.content_chunks += 1
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            result.prompt_tokens = usage.get("prompt_tokens")
            result.completion_tokens = usage.get("completion_tokens")
    if not done:
        raise StreamFailure(PROTOCOL, "stream ended without [DONE]")
    if result.ttft_s is None and finished and finished <= {"stop", "length"}:
        reasons = ", ".join(sorted(finished))
        raise StreamFailure(
            EMPTY_ANSWER,
            f"the answer has no text (finish_reason {reasons}, {result.completion_tokens} completion tokens)",
        )
    if result.ttft_s is None:
        raise StreamFailure(PROTOCOL, "stream carried no generated text")


async def send_request(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    body: dict[str, Any],
    result: RequestResult,
    timeout_s: float,
) -> RequestResult:
    """Send one streamed request and fill `result` in; every failure becomes an error cause, never an exception."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", endpoint.request_path, json=body, headers=endpoint.headers()) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    detail = f"HTTP {response.status_code}: {text[:200]}"
                    raise StreamFailure(status_cause(response.status_code), detail)
                await _consume_stream(response, result, started)
        result.e2e_s = time.perf_counter() - started
    except StreamFailure as exc:
        result.error, result.detail = exc.cause, exc.detail
    except (TimeoutError, httpx.TimeoutException) as exc:
        result.error, result.detail = TIMEOUT, f"no complete answer within {timeout_s:g} s ({type(exc).__name__})"
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        result.error, result.detail = CONNECTION, f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        result.error, result.detail = CONNECTION, f"{type(exc).__name__}: {exc}"
    return result
