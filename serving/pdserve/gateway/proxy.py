"""The prefill -> decode flow of vLLM's disaggregated-serving proxy, with timeouts and one retry per stage.

prefill: the request with max_tokens=1, stream=false, no stream_options/min_tokens, and kv_transfer_params asking for
remote decode; it answers kv_transfer_params naming where the KV waits. decode: the original request plus those params.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import httpx

from pdserve.kv.release import RELEASE_PATH
from pdserve.scheduler.protocol import RoutedInstance

from .metrics import GatewayMetrics
from .routing import NoRouteError, Plan, Router, alternative_decode
from .settings import GatewaySettings
from .streaming import DONE, carries_token, encode, error_event, kv_stats, sse_data, unfinished
from .validation import ValidRequest

log = logging.getLogger(__name__)
T = TypeVar("T")

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
RELEASE_TIMEOUT_S = 5.0
REQUIRED_KV_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
SUSPEND_SECONDS = 5.0
# engine_abort: an engine that aborts requests is usually shutting down (given_up)
SUSPENDING_CAUSES = frozenset(
    {"connect_error", "connect_timeout", "connection_lost", "engine_abort", "stream_truncated", "timeout"}
)


class UpstreamError(Exception):
    """An upstream call failed. `retriable` failures may be tried on another instance; others go to the client."""

    def __init__(
        self,
        role: str,
        cause: str,
        message: str,
        *,
        status: int = 502,
        retriable: bool = True,
        body: bytes | None = None,
    ) -> None:
        super().__init__(f"{role}: {message}")
        self.role, self.cause, self.status, self.retriable, self.body = role, cause, status, retriable, body


@dataclass
class Context:
    """One client request as it moves through the gateway; its fields end up in the request's log line."""

    request_id: str
    tenant: str
    request: ValidRequest
    started: float = field(default_factory=time.perf_counter)
    version: str = ""
    prefill_id: str | None = None
    decode_id: str | None = None
    route: str = ""
    retries: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> None:
        self.timings[name] = round(time.perf_counter() - self.started, 6)


def prefill_kv_transfer_params() -> dict[str, Any]:
    """What vLLM's disaggregated-serving proxy asks prefill for: keep the KV for a remote decode and say where."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    request = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    request.update(max_tokens=1, stream=False, kv_transfer_params=prefill_kv_transfer_params())
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None) -> dict[str, Any]:
    """Only params prefill returned reach decode: validation refuses a client's, and none survives here either."""
    request = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return request if kv_params is None else {**request, "kv_transfer_params": kv_params}


def finished_early(answer: Any) -> bool:
    """True for a prefill answer whose one token ended the request: finish_reason "stop" instead of "length"."""
    try:
        return bool(answer["choices"][0]["finish_reason"] == "stop")
    except (TypeError, KeyError, IndexError):
        return False


def status_error(role: str, response: httpx.Response, body: bytes) -> UpstreamError:
    status = response.status_code
    if status in (429, 503) or status >= 500:
        return UpstreamError(
            role, f"http_{status}", f"answered HTTP {status}", status=502 if status >= 500 else status, body=body
        )
    return UpstreamError(
        role, f"http_{status}", f"refused the request (HTTP {status})", status=status, retriable=False, body=body
    )


@dataclass
class Stream:
    """An open decode stream whose first event has arrived (so the request is committed to this instance)."""

    response: httpx.Response
    events: AsyncIterator[str]
    first: str
    exits: contextlib.ExitStack

    async def close(self) -> None:
        """Give back the upstream connection and the instance's in-flight count (idempotent)."""
        with anyio.CancelScope(shield=True):
            await self.response.aclose()
        self.exits.close()


class PDProxy:
    def __init__(
        self,
        settings: GatewaySettings,
        client: httpx.AsyncClient,
        router: Router,
        metrics: GatewayMetrics,
        server_auth: dict[str, str],
    ) -> None:
        self.settings, self.client, self.router, self.metrics = settings, client, router, metrics
        self.server_auth = server_auth
        """what prefill and decode require (contract §2); never the client's own key"""

    def plan(self, ctx: Context, exclude: frozenset[str] = frozenset()) -> Plan:
        try:
            plan = self.router.plan(ctx.request.prompt_tokens, self.settings.offload_threshold_tokens, exclude)
        except NoRouteError as exc:
            raise UpstreamError("routing", "no_route", str(exc), status=503, retriable=False) from None
        ctx.version, ctx.route = plan.version, plan.reason
        ctx.decode_id = plan.decode.instance_id
        ctx.prefill_id = plan.prefill.instance_id if plan.prefill else None
        return plan

    async def prefill(self, ctx: Context, plan: Plan) -> tuple[Plan, dict[str, Any] | None]:
        """Run remote prefill if the plan has one; a failure is retried once on another instance."""
        tried: set[str] = set()
        for attempt in (1, 2):
            if plan.prefill is None:
                return plan, None
            try:
                params = await self._call_prefill(ctx, plan.prefill)
                self._count_route(plan)
                if params is None:
                    ctx.route = "prefill_finished"
                return plan, params
            except UpstreamError as exc:
                self.failed(plan.prefill, exc)
                if attempt == 2 or not exc.retriable:
                    raise
                tried.add(plan.prefill.instance_id)
                self.metrics.retries.labels("prefill").inc()
                ctx.retries += 1
                plan = self.plan(ctx, frozenset(tried))
        raise AssertionError("unreachable")

    async def decode_json(self, ctx: Context, plan: Plan, kv_params: dict[str, Any] | None) -> httpx.Response:
        """Non-streaming decode; a failure is retried once on a compatible instance."""
        return await self._decode_with_retry(ctx, plan, lambda decode: self._call_decode_json(ctx, decode, kv_params))

    async def open_stream(self, ctx: Context, plan: Plan, kv_params: dict[str, Any] | None) -> Stream:
        """Streaming decode up to its first event; failing before that, it is retried once on another instance."""
        return await self._decode_with_retry(ctx, plan, lambda decode: self._open_stream(ctx, decode, kv_params))

    async def _decode_with_retry(self, ctx: Context, plan: Plan, call: Callable[[RoutedInstance], Awaitable[T]]) -> T:
        decode = plan.decode
        for attempt in (1, 2):
            try:
                result = await call(decode)
                self.metrics.routing.labels("decode", decode.instance_id, ctx.version, ctx.route).inc()
                return result
            except UpstreamError as exc:
                decode = self._retry_target(ctx, decode, exc, attempt)
        raise AssertionError("unreachable")

    async def relay(self, ctx: Context, stream: Stream) -> AsyncIterator[bytes]:
        """Pass decode's events to the client; if decode breaks off, send an error event and end the stream."""
        version = ctx.version
        last: float | None = None  # when the previous token-carrying event arrived

        def observe(data: str) -> None:
            nonlocal last
            self._observe_kv(data)
            if not carries_token(data):  # a chat stream opens with a role-only chunk: no token yet
                return
            now = time.perf_counter()
            if last is None:
                self.metrics.ttft.labels(version).observe(now - ctx.started)
                ctx.mark("first_token")
            else:
                self.metrics.itl.labels(version).observe(now - last)
            last = now

        observe(stream.first)
        try:
            yield encode(stream.first)
            if stream.first == DONE:
                return
            while True:
                data = await self._next_event(stream)
                if data is None:
                    raise UpstreamError("decode", "stream_truncated", "decode ended the stream without [DONE]")
                given_up(data)
                observe(data)
                yield encode(data)
                if data == DONE:
                    return
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels("decode", exc.cause).inc()
            self.metrics.stream_errors.labels(exc.cause).inc()
            if ctx.decode_id is not None:
                self.router.suspend(ctx.decode_id, SUSPEND_SECONDS)
            ctx.timings["stream_error"] = 1.0
            log.warning(
                "decode stream broken",
                extra={"fields": {"request_id": ctx.request_id, "decode": ctx.decode_id, "cause": exc.cause}},
            )
            yield error_event(f"decode failed mid-stream: {exc.cause}", "upstream_error", ctx.request_id)
        finally:
            await stream.close()

    async def _next_event(self, stream: Stream) -> str | None:
        try:
            return await asyncio.wait_for(anext(stream.events), self.settings.inter_token_timeout)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise UpstreamError("decode", "timeout", "no event within inter_token_timeout") from None
        except httpx.HTTPError as exc:
            raise UpstreamError("decode", "connection_lost", type(exc).__name__) from None

    def _retry_target(self, ctx: Context, failed: RoutedInstance, exc: UpstreamError, attempt: int) -> RoutedInstance:
        self.failed(failed, exc)
        if attempt == 2 or not exc.retriable:
            raise exc
        exclude = frozenset({failed.instance_id}) | self.router.suspended_ids()
        other = alternative_decode(self.router, failed, exclude)
        if other is None:
            raise exc
        self.metrics.retries.labels("decode").inc()
        ctx.retries += 1
        ctx.decode_id = other.instance_id
        return other

    def failed(self, instance: RoutedInstance, exc: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(exc.role, exc.cause).inc()
        if exc.cause in SUSPENDING_CAUSES or (exc.cause.startswith("http_5") and exc.cause != "http_503"):
            self.router.suspend(instance.instance_id, SUSPEND_SECONDS)
        log.warning(
            "upstream failed",
            extra={"fields": {"role": exc.role, "instance": instance.instance_id, "cause": exc.cause}},
        )

    def _count_route(self, plan: Plan) -> None:
        if plan.prefill is not None:
            self.metrics.routing.labels("prefill", plan.prefill.instance_id, plan.version, plan.reason).inc()

    def _headers(self, ctx: Context) -> dict[str, str]:
        return {"X-Request-Id": ctx.request_id, **self.server_auth}

    async def _call_prefill(self, ctx: Context, prefill: RoutedInstance) -> dict[str, Any] | None:
        """The KV's whereabouts; None when the prefill's one token ended the request (EOS or a stop string), so
        there is no KV to hand over (as vLLM, which exports KV only for requests cut at their length cap): decode
        then computes the prompt itself and samples the answer, as a colocated server would."""
        url = prefill.info.url + PATHS[ctx.request.endpoint]
        timeout = httpx.Timeout(self.settings.prefill_timeout, connect=self.settings.connect_timeout)
        started = time.perf_counter()
        ctx.prefill_id = prefill.instance_id
        with self.router.dispatched(prefill, ctx.request.prompt_tokens):
            response = await self.post("prefill", url, prefill_body(ctx.request.body), ctx, timeout)
        self.metrics.prefill.labels(ctx.version).observe(time.perf_counter() - started)
        ctx.mark("prefill_done")
        try:
            answer = response.json()
            params = answer.get("kv_transfer_params")
        except (ValueError, AttributeError):
            answer, params = None, None
        if not isinstance(params, dict):
            if finished_early(answer):
                return None
            raise UpstreamError("prefill", "bad_response", "answer has no kv_transfer_params")
        missing = [name for name in REQUIRED_KV_FIELDS if params.get(name) is None]
        if missing:
            raise UpstreamError("prefill", "bad_response", f"kv_transfer_params lacks {', '.join(missing)}")
        return params

    async def _call_decode_json(
        self, ctx: Context, decode: RoutedInstance, kv_params: dict[str, Any] | None
    ) -> httpx.Response:
        url = decode.info.url + PATHS[ctx.request.endpoint]
        timeout = httpx.Timeout(self.settings.request_timeout, connect=self.settings.connect_timeout)
        with self.router.dispatched(decode):
            response = await self.post("decode", url, decode_body(ctx.request.body, kv_params), ctx, timeout)
        self._observe_kv(response.text)
        given_up(response.text)
        return response

    async def release_kv(self, ctx: Context, prefill: RoutedInstance, kv_params: dict[str, Any]) -> None:
        """Ask prefill to free KV no decode will pull, counted by outcome: released, not_held (already freed),
        unsupported (a prefill without the endpoint, e.g. vLLM with NixlConnector: its KV is held until it expires)
        or failed. The contract: pdserve.kv.release."""
        url = prefill.info.url + RELEASE_PATH
        timeout = httpx.Timeout(RELEASE_TIMEOUT_S, connect=self.settings.connect_timeout)
        body = {"remote_request_id": kv_params.get("remote_request_id")}
        try:
            response = await self.client.post(url, json=body, headers=self._headers(ctx), timeout=timeout)
            released = response.json().get("released") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            response, released = None, None
        if released is not None:
            outcome = "released" if released else "not_held"
        else:
            outcome = "unsupported" if response is not None and response.status_code in (404, 405) else "failed"
        self.metrics.kv_releases.labels(outcome).inc()

    async def post(
        self, role: str, url: str, body: dict[str, Any], ctx: Context, timeout: httpx.Timeout
    ) -> httpx.Response:
        try:
            response = await self.client.post(url, json=body, headers=self._headers(ctx), timeout=timeout)
        except httpx.TimeoutException:
            raise UpstreamError(role, "timeout", "timed out", status=504) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(role, "connect_error", type(exc).__name__) from None
        if response.status_code != 200:
            raise status_error(role, response, response.content)
        return response

    async def _open_stream(self, ctx: Context, decode: RoutedInstance, kv_params: dict[str, Any] | None) -> Stream:
        exits = contextlib.ExitStack()
        exits.enter_context(self.router.dispatched(decode))
        url = decode.info.url + PATHS[ctx.request.endpoint]
        timeout = httpx.Timeout(None, connect=self.settings.connect_timeout)
        request = self.client.build_request(
            "POST", url, json=decode_body(ctx.request.body, kv_params), headers=self._headers(ctx), timeout=timeout
        )
        response: httpx.Response | None = None
        try:
            async with asyncio.timeout(self.settings.first_token_timeout):
                response = await self.client.send(request, stream=True)
                if response.status_code != 200:
                    raise status_error("decode", response, await response.aread())
                events = sse_data(response)
                first = await anext(events)
                given_up(first)  # nothing reached the client yet: another decode may still answer
            return Stream(response, events, first, exits)
        except BaseException as exc:
            if response is not None:
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            exits.close()
            raise _as_upstream_error(exc) from None

    def _observe_kv(self, data: str) -> None:
        stats = kv_stats(data)
        if stats is None:
            return
        if isinstance(stats.get("bytes"), int | float):
            self.metrics.kv_bytes.observe(stats["bytes"])
        if isinstance(stats.get("seconds"), int | float):
            self.metrics.kv_seconds.observe(stats["seconds"])
        if stats.get("source") in ("remote", "recompute", "local"):
            self.metrics.kv_source.labels(stats["source"]).inc()


def given_up(data: str) -> None:
    """Raise for decode's event or answer that gives its choice up (finish_reason abort or error): relayed, the
    client would take an empty or cut-short text for a whole one."""
    reason = unfinished(data)
    if reason is not None:
        raise UpstreamError("decode", f"engine_{reason}", f"decode gave the request up (finish_reason {reason!r})")


def _as_upstream_error(exc: BaseException) -> BaseException:
    if isinstance(exc, UpstreamError | asyncio.CancelledError):
        return exc
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamError(
            "decode", "connect_timeout", "decode did not accept the connection within connect_timeout", status=504
        )
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return UpstreamError("decode", "timeout", "no first event within first_token_timeout", status=504)
    if isinstance(exc, StopAsyncIteration):
        return UpstreamError("decode", "stream_truncated", "decode closed the stream before any event")
    if isinstance(exc, httpx.HTTPError):
        return UpstreamError("decode", "connect_error", type(exc).__name__)
    return exc
