"""The OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (JSON or SSE) and /v1/models."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve import jsonbody
from pdserve.engine import EngineError, TokenOutput
from pdserve.kv import KVTransferError
from pdserve.server import faults
from pdserve.server.batching import CapacityError
from pdserve.server.generation import DEFAULT_COMPLETION_TOKENS, Generation, GenerationService
from pdserve.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    parse_request,
)

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def as_error_response(error: BaseException) -> JSONResponse:
    """The HTTP answer for an error raised while serving a request."""
    if isinstance(error, RequestError):
        return error_response(error.status, error.message, error.kind, error.param)
    if isinstance(error, CapacityError):
        return error_response(error.status, error.message, f"server_full_{error.reason}")
    if isinstance(error, KVTransferError) and error.cause == "capacity":
        return error_response(503, f"KV lease store full: {error.message}", "server_full_kv_store")
    if isinstance(error, EngineError):
        return error_response(500, f"engine error: {error}", "engine_error")
    if isinstance(error, ClientDisconnect):  # gone before its body was complete (or cut off by the body deadline)
        return error_response(499, "client closed the request before its body was complete", "client_closed")
    log.error("unexpected error", exc_info=error)
    return error_response(500, "internal server error", "internal_error")


class OpenAIEndpoints:
    def __init__(
        self, service_ref: Callable[[], GenerationService | None], model_name: str, max_body_bytes: int = 4_194_304
    ) -> None:
        self._ref = service_ref  # None while the model loads
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes

    @property
    def service(self) -> GenerationService:
        service: GenerationService | None = self._ref()
        if service is None:
            raise RequestError(
                "the model is still loading; retry once /health/ready answers 200", status=503, kind="not_ready"
            )
        return service

    async def models(self, request: Request) -> Response:
        service = self._ref()
        entry: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pdserve",
        }
        if service is not None:
            entry["max_model_len"] = service.max_model_len
        return JSONResponse({"object": "list", "data": [entry]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        request_id = request.state.request_id
        try:
            parsed, generation = await self._admit(request, chat, request_id)
        except Exception as error:
            return as_error_response(error)
        # From here the generation holds a slot: each way out below closes it (close is idempotent).
        formatter = _Formatter(chat, self.model_name, request_id, parsed.return_token_ids)
        formatter.kv_transfer_stats = generation.kv_transfer_stats
        if parsed.stream:
            return _GenerationStream(generation, _sse(generation, formatter, parsed.include_usage))
        try:
            if not await _collect_unless_disconnected(request, generation):
                return error_response(499, "client closed the request", "client_closed")
            return JSONResponse(formatter.full(generation))
        except Exception as error:
            return as_error_response(error)
        finally:
            generation.close()

    async def _admit(
        self, request: Request, chat: bool, request_id: str
    ) -> tuple[ChatCompletionRequest | CompletionRequest, Generation]:
        """Parse, check and admit a request; nothing is reserved unless this returns."""
        body = await json_body(request, self.max_body_bytes)
        service = self.service
        await faults.before_request(service.settings)
        parsed: ChatCompletionRequest | CompletionRequest
        if chat:
            parsed = parse_request(ChatCompletionRequest, body)
            self._check_model(parsed.model)
            prompt_ids = service.chat_prompt(parsed)
            max_tokens = service.max_tokens(parsed, len(prompt_ids), None)
        else:
            parsed = parse_request(CompletionRequest, body)
            self._check_model(parsed.model)
            prompt_ids = service.completion_prompt(parsed)
            max_tokens = service.max_tokens(parsed, len(prompt_ids), DEFAULT_COMPLETION_TOKENS)
        return parsed, await service.start(parsed, prompt_ids, max_tokens, request_id)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                f"model: {model!r} is not served here (this server serves {self.model_name!r})",
                param="model",
                status=404,
                kind="model_not_found",
            )


async def _drain(generation: Generation) -> None:
    async for _ in generation.outputs():
        pass


async def _collect_unless_disconnected(request: Request, generation: Generation) -> bool:
    """Run a non-streaming request to its end; stop generating (False) if the client goes away first."""
    collecting = asyncio.ensure_future(_drain(generation))
    while not collecting.done():
        await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S)
        if not collecting.done() and await request.is_disconnected():
            collecting.cancel()
            generation.close()
            return False
    collecting.result()
    return True


async def json_body(request: Request, limit: int) -> Any:
    """The request's JSON body, read up to `limit` bytes (413 beyond)."""
    try:
        return jsonbody.loads(await jsonbody.read_body(request, limit))
    except jsonbody.BodyError as error:
        raise RequestError(f"{error.field}: {error.message}", param=error.field, status=error.status) from None


class _GenerationStream(StreamingResponse):
    """An SSE response that closes its generation however the response ends. The body iterator's own finally does
    not suffice: a client that is gone before streaming starts cancels the response before the iterator runs."""

    def __init__(self, generation: Generation, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


class _Formatter:
    """Builds OpenAI response objects for one request."""

    def __init__(self, chat: bool, model: str, request_id: str, return_token_ids: bool = False) -> None:
        self.chat = chat
        self.return_token_ids = return_token_ids
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.kv_transfer_stats: dict[str, Any] | None = None

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(generation: Generation) -> dict[str, int]:
        return {
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
            "total_tokens": generation.prompt_tokens + generation.completion_tokens,
        }

    def full(self, generation: Generation) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": generation.text},
                "logprobs": None,
                "finish_reason": generation.finish_reason,
            }
            body = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": generation.text, "logprobs": None, "finish_reason": generation.finish_reason}
            body = self._envelope("text_completion")
        if self.return_token_ids:
            choice["prompt_token_ids"] = list(generation.sequence.prompt_ids)
            choice["token_ids"] = list(generation.sequence.state.token_ids)
        body["choices"] = [choice]
        body["usage"] = self.usage(generation)
        body["kv_transfer_params"] = generation.kv_transfer_params()
        if generation.kv_transfer_stats is not None:
            body["kv_transfer_stats"] = generation.kv_transfer_stats
        return body

    def chunk(self, output: TokenOutput | None, first: bool = False) -> dict[str, Any]:
        text = output.text if output is not None else None
        finish_reason = output.finish_reason if output is not None else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        if self.return_token_ids and output is not None:
            choice["token_ids"] = [output.token_id]
        body["choices"] = [choice]
        if finish_reason is not None and self.kv_transfer_stats is not None:
            body["kv_transfer_stats"] = self.kv_transfer_stats  # on the last chunk, for the gateway's metrics
        return body

    def usage_chunk(self, generation: Generation) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self.usage(generation)
        return body


def _event(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body)
    return f"data: {data}\n\n".encode()


async def _sse(generation: Generation, formatter: _Formatter, include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per token with new text, a final chunk with finish_reason, then [DONE].
    An error after the stream began is sent as an error event (the status line has already gone out)."""
    try:
        if formatter.chat:
            yield _event(formatter.chunk(None, first=True))
        async for output in generation.outputs():
            if output.finished or output.text or formatter.return_token_ids:
                yield _event(formatter.chunk(output))
        if include_usage:
            yield _event(formatter.usage_chunk(generation))
    except Exception as error:
        response = as_error_response(error)
        yield _event(json.loads(bytes(response.body)))
    finally:
        generation.close()  # the client may have gone: stop generating for it
    yield _event("[DONE]")
