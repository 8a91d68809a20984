"""The gateway's HTTP surface: /v1/completions, /v1/chat/completions, /v1/models, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.scheduler.protocol import RoutingTable

from .auth import KeyStore, TenantLimits
from .metrics import GatewayMetrics
from .proxy import Context, PDProxy, Stream, UpstreamError
from .ratelimit import RateLimiter
from .routing import Router
from .settings import GatewaySettings
from .validation import Endpoint, PromptCounter, RequestError, parse_body, validate

log = logging.getLogger(__name__)
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
CLIENT_CLOSED = 499
UPSTREAM_KEEPALIVE_S = 3.0


def openai_error(status: int, message: str, error_type: str, request_id: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers={"X-Request-Id": request_id, **(headers or {})})


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = KeyStore.from_file(settings.api_keys_file)
        defaults = TenantLimits(requests_per_second=settings.requests_per_second,
                                request_burst=settings.request_burst, tokens_per_minute=settings.tokens_per_minute)
        self.limiter = RateLimiter(defaults, self.keys.limits)
        self.counter = PromptCounter(settings.tokenizer_file)
        self.metrics = GatewayMetrics()
        self.router = Router()
        # Idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them from the server side;
        # at equal timeouts the gateway could send a request on a connection the server is just closing.
        limits = httpx.Limits(max_connections=settings.max_connections,
                              max_keepalive_connections=settings.max_connections, keepalive_expiry=UPSTREAM_KEEPALIVE_S)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, connect=settings.connect_timeout))
        self.proxy = PDProxy(settings, self.client, self.router, self.metrics)

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        incoming_id = request.headers.get("x-request-id", "")
        request_id = incoming_id if REQUEST_ID.match(incoming_id) else uuid.uuid4().hex
        tenant = self.keys.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            self.metrics.auth_failures.inc()
            self._count(endpoint, 401, "unauthenticated", "")
            return openai_error(401, "invalid or missing API key", "authentication_error", request_id)
        try:
            valid = validate(endpoint, parse_body(await self._read_body(request), self.settings), self.settings,
                             self.counter)
        except RequestError as exc:
            self.metrics.invalid.labels(exc.field).inc()
            self._count(endpoint, exc.status, tenant, "")
            return openai_error(exc.status, str(exc), "invalid_request_error", request_id, param=exc.field)
        refusal = self._rate_limit(endpoint, tenant, valid.prompt_tokens + valid.max_tokens, request_id)
        if refusal is not None:
            return refusal
        ctx = Context(request_id, tenant, valid)
        self.metrics.inflight.inc()
        return await self._run(request, ctx)

    def _rate_limit(self, endpoint: Endpoint, tenant: str, cost: int, request_id: str) -> Response | None:
        budget = self.limiter.token_budget(tenant)
        if cost > budget:
            self._count(endpoint, 400, tenant, "")
            message = f"max_tokens: prompt plus max_tokens ({cost}) exceeds this tenant's tokens_per_minute ({budget})"
            return openai_error(400, message, "invalid_request_error", request_id, param="max_tokens")
        decision = self.limiter.check(tenant, cost)
        if decision.allowed:
            return None
        self.metrics.rate_limited.labels(tenant, decision.limit).inc()
        self._count(endpoint, 429, tenant, "")
        return openai_error(429, f"rate limit exceeded ({decision.limit}); retry after {decision.retry_after}s",
                            "rate_limit_error", request_id, headers={"Retry-After": str(decision.retry_after)})

    async def _run(self, request: Request, ctx: Context) -> Response:
        """Prefill and decode up to the first token, abandoning the upstream work if the client goes away."""
        work = asyncio.create_task(self._start(ctx))
        gone = asyncio.create_task(_wait_for_disconnect(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            self.metrics.client_disconnects.inc()
            self._finish(ctx, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        try:
            outcome = work.result()
        except UpstreamError as exc:
            self._finish(ctx, exc.status, cause=exc.cause)
            if exc.body is not None and not exc.retriable:
                return Response(exc.body, status_code=exc.status, media_type="application/json",
                                headers={"X-Request-Id": ctx.request_id})
            return openai_error(exc.status, str(exc), "upstream_error", ctx.request_id)
        if isinstance(outcome, Stream):
            headers = {"X-Request-Id": ctx.request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._stream(ctx, outcome), media_type="text/event-stream", headers=headers)
        self._finish(ctx, 200)
        return Response(outcome.content, media_type="application/json", headers={"X-Request-Id": ctx.request_id})

    async def _start(self, ctx: Context) -> Stream | httpx.Response:
        plan = self.proxy.plan(ctx)
        plan, kv_params = await self.proxy.prefill(ctx, plan)
        if ctx.request.stream:
            return await self.proxy.open_stream(ctx, plan, kv_params)
        return await self.proxy.decode_json(ctx, plan, kv_params)

    async def _stream(self, ctx: Context, stream: Stream) -> AsyncIterator[bytes]:
        status = CLIENT_CLOSED
        try:
            async for chunk in self.proxy.relay(ctx, stream):
                yield chunk
            status = 502 if "stream_error" in ctx.timings else 200
        finally:
            if status == CLIENT_CLOSED:
                self.metrics.client_disconnects.inc()
            self._finish(ctx, status)

    def _finish(self, ctx: Context, status: int, cause: str = "") -> None:
        elapsed = time.perf_counter() - ctx.started
        self.metrics.inflight.dec()
        self._count(ctx.request.endpoint, status, ctx.tenant, ctx.version)
        self.metrics.e2e.labels(ctx.request.endpoint, ctx.version).observe(elapsed)
        fields: dict[str, Any] = {
            "request_id": ctx.request_id, "tenant": ctx.tenant, "endpoint": ctx.request.endpoint, "status": status,
            "version": ctx.version, "route": ctx.route, "prefill": ctx.prefill_id, "decode": ctx.decode_id,
            "retries": ctx.retries, "prompt_tokens": ctx.request.prompt_tokens, "stream": ctx.request.stream,
            "seconds": round(elapsed, 6), **ctx.timings}
        if cause:
            fields["cause"] = cause
        if self.settings.log_prompts:
            fields["prompt"] = ctx.request.prompt_text()
        log.info("request", extra={"fields": fields})

    def _count(self, endpoint: str, status: int, tenant: str, version: str) -> None:
        self.metrics.requests.labels(endpoint, str(status), tenant, version).inc()

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise RequestError("body", f"request body of {declared} bytes exceeds {limit}", status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError("body", f"request body exceeds {limit} bytes", status=413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def poll_routing_table(self) -> None:
        url = self.settings.scheduler_url.rstrip("/") + "/v1/routing"
        etag = ""
        while True:
            try:
                response = await self.client.get(url, headers={"If-None-Match": etag} if etag else {}, timeout=2.0)
                if response.status_code == 200:
                    self.router.table = RoutingTable.model_validate(response.json())
                    etag = response.headers.get("etag", "")
                    self.metrics.table_generation.set(self.router.table.generation)
                elif response.status_code != 304:
                    self.metrics.table_errors.inc()
            except (httpx.HTTPError, ValueError) as exc:
                self.metrics.table_errors.inc()
                log.warning("routing table poll failed; keeping the last table",
                            extra={"fields": {"cause": type(exc).__name__}})
            await asyncio.sleep(self.settings.routing_poll_interval)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def completions(request: Request) -> Response:
    return await gateway_of(request).handle(request, "completions")


async def chat_completions(request: Request) -> Response:
    return await gateway_of(request).handle(request, "chat")


async def models(request: Request) -> Response:
    gateway = gateway_of(request)
    if gateway.keys.tenant_for(request.headers.get("authorization")) is None:
        gateway.metrics.auth_failures.inc()
        return openai_error(401, "invalid or missing API key", "authentication_error", uuid.uuid4().hex)
    names = sorted({i.info.model for i in gateway.router.table.instances if i.info.model})
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "pdstack"} for name in names]
    return JSONResponse({"object": "list", "data": data})


async def live(request: Request) -> Response:
    return JSONResponse({"status": "live"})


async def ready(request: Request) -> Response:
    table = gateway_of(request).router.table
    decodes = sum(1 for i in table.instances if i.info.role in ("decode", "colocated"))
    body = {"routing_generation": table.generation, "instances": len(table.instances), "decode_instances": decodes}
    return JSONResponse({"status": "ready" if decodes else "no decode instance", **body},
                        status_code=200 if decodes else 503)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(gateway_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: GatewaySettings) -> Starlette:
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        poller = asyncio.create_task(gateway.poll_routing_table())
        try:
            yield
        finally:
            poller.cancel()
            await gateway.client.aclose()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health/live", live), Route("/health/ready", ready), Route("/metrics", metrics),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    return app
