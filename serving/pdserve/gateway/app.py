"""The gateway's HTTP surface: /v1/completions, /v1/chat/completions, /v1/models, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import httpx
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve import jsonbody
from pdserve.common.routes import probe_routes
from pdserve.common.tls import client_context
from pdserve.scheduler.client import bearer, read_token
from pdserve.scheduler.protocol import RoutingTable

from .accounting import CLIENT_CLOSED, Accounting, Record, record_of
from .auth import KeyStore, TenantLimits
from .early import EarlyDispatch, read_params_key, streams_kv
from .metrics import GatewayMetrics, field_label
from .proxy import Context, PDProxy, Stream, UpstreamError
from .ratelimit import RateLimiter
from .routing import Plan, Router
from .settings import GatewaySettings
from .validation import Endpoint, PromptCounter, RequestError, check_fleet, parse_body, validate

log = logging.getLogger(__name__)
UPSTREAM_KEEPALIVE_S = 3.0


def openai_error(
    status: int,
    message: str,
    error_type: str,
    request_id: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers={"X-Request-Id": request_id, **(headers or {})})


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = KeyStore.from_file(settings.api_keys_file)
        self.scheduler_auth = bearer(read_token(settings.scheduler_token_file, "scheduler_token_file"))
        self.server_auth = bearer(read_token(settings.server_token_file, "server_token_file"))
        password = None
        if settings.rate_limit_password_file is not None:
            password = read_token(settings.rate_limit_password_file, "rate_limit_password_file")
        self.metrics_auth: bytes | None = None
        """What /metrics requires as its Authorization header (None: open, on a loopback listener only)"""
        if settings.metrics_token_file is not None:
            try:
                token = read_token(settings.metrics_token_file, "metrics_token_file")
            except ValueError as error:  # a missing or empty file stops the start, naming the setting
                raise SystemExit(f"pdserve gateway: invalid configuration: {error}") from None
            self.metrics_auth = bearer(token)["Authorization"].encode()
        self.metrics = GatewayMetrics()
        defaults = TenantLimits(
            requests_per_second=settings.requests_per_second,
            request_burst=settings.request_burst,
            tokens_per_minute=settings.tokens_per_minute,
            max_concurrent_requests=settings.tenant_max_concurrent_requests,
        )
        self.limiter = RateLimiter(
            defaults,
            self.keys.limits,
            settings.rate_limit_storage,
            password,
            self.metrics.rate_limit_shared,
            tls=settings,
        )
        self.counter = PromptCounter(settings.tokenizer_file)
        self.router = Router()
        self.background: set[asyncio.Task[None]] = set()
        self.active: dict[str, int] = defaultdict(int)
        """requests in progress per tenant (tenant_max_concurrent_requests)"""
        # Idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them from the server side;
        # at equal timeouts the gateway could send a request on a connection the server is just closing.
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            keepalive_expiry=UPSTREAM_KEEPALIVE_S,
        )
        self.client = httpx.AsyncClient(
            limits=limits,
            timeout=httpx.Timeout(30.0, connect=settings.connect_timeout),
            verify=client_context(settings),  # scheduler, prefill and decode over https
        )
        self.proxy = PDProxy(settings, self.client, self.router, self.metrics, self.server_auth)
        self.early: EarlyDispatch | None = None
        if settings.kv_params_key_file is not None:
            self.early = EarlyDispatch(self.proxy, read_params_key(settings.kv_params_key_file))

    def authenticate(self, request: Request, record: Record) -> Response | None:
        tenant = self.keys.tenant_for(request.headers.get("authorization"))
        if tenant is None:
            self.metrics.auth_failures.inc()
            record.tenant, record.error = "unauthenticated", "authorization"
            return openai_error(
                401,
                "authorization: invalid or missing API key",
                "authentication_error",
                record.request_id,
                param="authorization",
            )
        record.tenant = tenant
        return None

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        record = record_of(request.scope)
        refusal = self.authenticate(request, record) or self._hold_slot(record) or await self._before_body(record)
        if refusal is not None:
            return refusal
        try:
            body = parse_body(await self._read_body(request), self.settings)
            valid = validate(endpoint, body, self.settings, self.counter)
            check_fleet(valid, self.router.table.instances)
        except RequestError as exc:
            self.metrics.invalid.labels(field_label(exc.field)).inc()
            record.error = exc.field[:128]  # a client may name a field with 30 KB
            return openai_error(exc.status, str(exc), "invalid_request_error", record.request_id, param=exc.field)
        refusal = await self._rate_limit(record, valid.prompt_tokens + valid.max_tokens)
        if refusal is not None:
            return refusal
        ctx = Context(record.request_id, record.tenant, valid)
        record.dispatched = True
        return await self._run(request, ctx, record)

    def _hold_slot(self, record: Record) -> Response | None:
        """One of the tenant's concurrent-request slots until the response is over, or 429 when all are taken."""
        tenant = record.tenant
        if self.active[tenant] >= self.limiter.concurrency_cap(tenant):
            return self._too_many(record, "concurrency", 1)
        self.active[tenant] += 1

        async def release() -> None:
            self.active[tenant] -= 1

        record.cleanups.append(release)
        return None

    async def _before_body(self, record: Record) -> Response | None:
        decision = await self.limiter.spent(record.tenant)
        return None if decision.allowed else self._too_many(record, decision.limit, decision.retry_after)

    def _too_many(self, record: Record, limit: str, retry_after: int) -> Response:
        self.metrics.rate_limited.labels(record.tenant, limit).inc()
        record.error = f"rate_limit_{limit}"
        return openai_error(
            429,
            f"rate limit exceeded ({limit}); retry after {retry_after}s",
            "rate_limit_error",
            record.request_id,
            headers={"Retry-After": str(retry_after)},
        )

    async def _rate_limit(self, record: Record, cost: int) -> Response | None:
        tenant = record.tenant
        budget = self.limiter.token_budget(tenant)
        if cost > budget:
            record.error = "max_tokens"
            message = f"max_tokens: prompt plus max_tokens ({cost}) exceeds this tenant's tokens_per_minute ({budget})"
            return openai_error(400, message, "invalid_request_error", record.request_id, param="max_tokens")
        decision = await self.limiter.check(tenant, cost)
        return None if decision.allowed else self._too_many(record, decision.limit, decision.retry_after)

    async def _run(self, request: Request, ctx: Context, record: Record) -> Response:
        """Prefill and decode up to the first token, abandoning the upstream work if the client goes away."""
        work = asyncio.create_task(self._start(ctx))
        gone = asyncio.create_task(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self._describe(ctx, record)
        if work.cancelled():
            self.metrics.client_disconnects.inc()
            record.status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED)
        try:
            outcome = work.result()
        except UpstreamError as exc:
            record.error = exc.cause
            if exc.body is not None and not exc.retriable:
                return Response(
                    exc.body,
                    status_code=exc.status,
                    media_type="application/json",
                    headers={"X-Request-Id": ctx.request_id},
                )
            return openai_error(exc.status, str(exc), "upstream_error", ctx.request_id)
        if isinstance(outcome, Stream):
            record.status = CLIENT_CLOSED  # until the stream ends: a body never iterated means the client left
            record.cleanups.append(outcome.close)
            headers = {"X-Request-Id": ctx.request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                self._stream(ctx, outcome, record), media_type="text/event-stream", headers=headers
            )
        return Response(outcome.content, media_type="application/json", headers={"X-Request-Id": ctx.request_id})

    async def _start(self, ctx: Context) -> Stream | httpx.Response:
        plan = self.proxy.plan(ctx)
        if self.early is not None and streams_kv(plan):
            return await self._start_early(ctx, plan)
        plan, kv_params = await self.proxy.prefill(ctx, plan)
        try:
            return await self._decode(ctx, plan, kv_params)
        except BaseException:  # decode refused or failed, or the client left: nobody will pull this KV
            if kv_params is not None and plan.prefill is not None:
                self._spawn(self.proxy.release_kv(ctx, plan.prefill, kv_params))
            raise

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` beside the request (which may be being cancelled), kept until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _start_early(self, ctx: Context, plan: Plan) -> Stream | httpx.Response:
        """Prefill and decode at once; prefill is abandoned if decode fails or the client leaves first."""
        assert self.early is not None
        kv_params, prefill = self.early.start(ctx, plan)
        try:
            return await self._decode(ctx, plan, kv_params)
        except BaseException:
            prefill.cancel()
            raise

    async def _decode(self, ctx: Context, plan: Plan, kv_params: dict[str, Any] | None) -> Stream | httpx.Response:
        if ctx.request.stream:
            return await self.proxy.open_stream(ctx, plan, kv_params)
        return await self.proxy.decode_json(ctx, plan, kv_params)

    async def _stream(self, ctx: Context, stream: Stream, record: Record) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.proxy.relay(ctx, stream):
                yield chunk
            record.status = 502 if "stream_error" in ctx.timings else 200
        finally:
            if record.status == CLIENT_CLOSED:
                self.metrics.client_disconnects.inc()
            self._describe(ctx, record)

    def _describe(self, ctx: Context, record: Record) -> None:
        """What the request's log line tells about its route, once the route is known."""
        record.version = ctx.version
        record.fields.update(
            {
                "route": ctx.route,
                "prefill": ctx.prefill_id,
                "decode": ctx.decode_id,
                "retries": ctx.retries,
                "prompt_tokens": ctx.request.prompt_tokens,
                "stream": ctx.request.stream,
                **ctx.timings,
            }
        )
        record.fields["prompt_text"] = ctx.request.prompt_text
        route = {
            "pdserve.route": ctx.route,
            "pdserve.prefill": ctx.prefill_id,
            "pdserve.decode": ctx.decode_id,
            "pdserve.retries": ctx.retries,
            "pdserve.prompt_tokens": ctx.request.prompt_tokens,
        }
        trace.get_current_span().set_attributes({k: v for k, v in route.items() if v is not None})
        if self.settings.trace_prompts:  # into the request's span, which ends with the response's last byte
            trace.get_current_span().set_attribute("pdserve.prompt", ctx.request.prompt_text())

    def prompt_for_log(self, record: Record) -> str | None:
        prompt_text = record.fields.pop("prompt_text", None)
        return prompt_text() if self.settings.log_prompts and prompt_text is not None else None

    async def _read_body(self, request: Request) -> bytes:
        try:
            return await jsonbody.read_body(request, self.settings.max_body_bytes)
        except jsonbody.BodyError as exc:
            raise RequestError(exc.field, exc.message, status=exc.status) from None

    async def poll_routing_table(self) -> None:
        url = self.settings.scheduler_url.rstrip("/") + "/v1/routing"
        etag = ""
        while True:
            try:
                headers = {**self.scheduler_auth, **({"If-None-Match": etag} if etag else {})}
                response = await self.client.get(url, headers=headers, timeout=2.0)
                if response.status_code == 200:
                    self.router.table = RoutingTable.model_validate(response.json())
                    etag = response.headers.get("etag", "")
                    self.metrics.table_generation.set(self.router.table.generation)
                elif response.status_code != 304:
                    self.metrics.table_errors.inc()
                    log.warning(
                        "routing table poll refused; keeping the last table",
                        extra={"fields": {"status": response.status_code}},
                    )
            except (httpx.HTTPError, ValueError) as exc:
                self.metrics.table_errors.inc()
                log.warning(
                    "routing table poll failed; keeping the last table", extra={"fields": {"cause": type(exc).__name__}}
                )
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
    refusal = gateway.authenticate(request, record_of(request.scope))
    if refusal is not None:
        return refusal
    names = sorted({i.info.model for i in gateway.router.table.instances if i.info.model})
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "pdstack"} for name in names]
    return JSONResponse({"object": "list", "data": data})


async def no_route(request: Request, exc: Exception) -> Response:
    """404 and 405 as OpenAI errors naming what is wrong: the path, or the method."""
    status = getattr(exc, "status_code", 404)
    field = "method" if status == 405 else "path"
    message = (
        f"{field}: no {request.method} {request.url.path} here"
        if status == 405
        else f"path: no endpoint at {request.url.path}"
    )
    record: Record | None = request.scope.get("state", {}).get("record")  # none on uncounted paths (/health/x)
    request_id = record.request_id if record is not None else uuid.uuid4().hex
    return openai_error(status, message, "invalid_request_error", request_id, param=field)


async def live(request: Request) -> Response:
    return JSONResponse({"status": "live"})


async def ready(request: Request) -> Response:
    table = gateway_of(request).router.table
    decodes = sum(1 for i in table.instances if i.info.role in ("decode", "colocated"))
    body = {"routing_generation": table.generation, "instances": len(table.instances), "decode_instances": decodes}
    return JSONResponse(
        {"status": "ready" if decodes else "no decode instance", **body}, status_code=200 if decodes else 503
    )


async def metrics(request: Request) -> Response:
    """The gateway's series (tenants, versions, instances) for the holder of the metrics token only: Prometheus."""
    gateway = gateway_of(request)
    if gateway.metrics_auth is not None:
        presented = next((value for name, value in request.scope["headers"] if name == b"authorization"), b"")
        if not hmac.compare_digest(presented, gateway.metrics_auth):
            problem = "missing" if not presented else "wrong"
            return openai_error(
                401,
                f"authorization: {problem} metrics token: /metrics takes 'Authorization: Bearer <metrics token>'",
                "authentication_error",
                uuid.uuid4().hex,
                param="authorization",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: GatewaySettings) -> Starlette:
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.limiter.start()
        poller = asyncio.create_task(gateway.poll_routing_table())
        try:
            yield
        finally:
            poller.cancel()
            for task in gateway.background:
                task.cancel()
            await asyncio.gather(*gateway.background, return_exceptions=True)
            await gateway.limiter.stop()
            await gateway.client.aclose()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        *probe_routes(live, ready, metrics),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: no_route, 405: no_route},
        middleware=[Middleware(Accounting, metrics=gateway.metrics, log_prompts=gateway.prompt_for_log)],
    )
    app.state.gateway = gateway
    return app
