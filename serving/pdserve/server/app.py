"""The app factory all three roles share: routes, lifespan (model load in the background, KV channel, batch loop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.common.logs import bind_request_id, reset_request_id
from pdserve.common.registry import component_registry
from pdserve.common.routes import probe_routes
from pdserve.engine import Engine
from pdserve.kv import SecretKey
from pdserve.kv.release import RELEASE_PATH
from pdserve.scheduler.client import read_token
from pdserve.server.auth import BearerTokenMiddleware
from pdserve.server.batching import Admission, BatchScheduler
from pdserve.server.generation import GenerationService
from pdserve.server.heartbeat import read_scheduler_token, start_heartbeats
from pdserve.server.kvlink import DecodeImporter, PrefillExporter
from pdserve.server.leases import release_kv
from pdserve.server.metrics import ServerMetrics
from pdserve.server.openai_api import OpenAIEndpoints
from pdserve.server.settings import Role, ServerSettings

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes read: the loaded service (None while loading) and why loading failed, if it did."""

    settings: ServerSettings
    metrics: ServerMetrics
    service: GenerationService | None = None
    load_error: str | None = None
    exporter: PrefillExporter | None = None
    background: list[asyncio.Task[None]] = field(default_factory=list)


async def load_service(state: ServerState) -> None:
    settings = state.settings
    try:
        scheduler_token = read_scheduler_token(settings)
        engine = await asyncio.to_thread(Engine.load, settings.model)
        key = SecretKey.from_file(settings.kv_key_file) if settings.kv_key_file is not None else None
        exporter = importer = None
        if settings.role is Role.PREFILL:
            assert key is not None
            exporter = PrefillExporter(settings, engine, key, state.metrics)
            await exporter.start()
            state.exporter = exporter
        elif settings.role is Role.DECODE:
            assert key is not None
            importer = DecodeImporter(settings, engine, key, state.metrics)
        scheduler = BatchScheduler(engine, settings.prefill_token_budget, state.metrics)
        scheduler.start()
        admission = Admission(settings.max_num_seqs, settings.kv_memory_bytes, state.metrics)
        state.metrics.bind_router_gauges(waiting=lambda: admission.waiting, kv_usage=lambda: admission.usage)
        state.service = GenerationService(
            settings, engine, scheduler, admission, state.metrics, exporter=exporter, importer=importer
        )
    except Exception as error:
        state.load_error = f"{type(error).__name__}: {error}"
        log.error("model load failed", extra={"error": state.load_error})
        return
    state.metrics.ready.set(1)
    log.info(
        "ready",
        extra={
            "role": settings.role.value,
            "model": settings.model_name,
            "fingerprint": engine.fingerprint,
            "kv_port": exporter.server.port if exporter is not None else None,
            "engine_id": settings.engine_id,
        },
    )
    heartbeat = start_heartbeats(settings, scheduler_token, state.service, exporter)
    if heartbeat is not None:
        state.background.append(heartbeat)


def read_api_token(settings: ServerSettings) -> str | None:
    """The API token, read at start so that a missing or empty file stops the server with a clear message."""
    if settings.api_token_file is None:
        return None
    try:
        return read_token(settings.api_token_file, "api_token_file")
    except ValueError as error:
        raise SystemExit(f"pdserve {settings.role.value}: invalid configuration: {error}") from None


def create_app(settings: ServerSettings, registry: CollectorRegistry | None = None) -> Starlette:
    metrics = ServerMetrics(registry if registry is not None else component_registry())
    metrics.build.labels(settings.version, settings.role.value).set(1)
    state = ServerState(settings, metrics)
    api_token = read_api_token(settings)
    endpoints = OpenAIEndpoints(lambda: state.service, settings.model_name, settings.max_body_bytes)

    async def live(request: Request) -> Response:
        return JSONResponse({"status": "live", "role": settings.role.value})

    async def ready(request: Request) -> Response:
        """Ready or not, and nothing more: the path is open, so no KV port, engine id, model or load error (the
        scheduler registration carries what peers need; the "ready" and "model load failed" log lines the rest)."""
        if state.service is None:
            reason = "model load failed" if state.load_error else "model loading"
            return JSONResponse({"status": "not_ready", "reason": reason}, 503)
        return JSONResponse({"status": "ready"})

    async def health(request: Request) -> Response:
        """vLLM's probe: 200 once the model is loaded, 503 before (or when loading failed)."""
        return Response(status_code=200 if state.service is not None else 503)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.background.append(asyncio.create_task(load_service(state)))
        try:
            yield
        finally:
            for task in state.background:
                task.cancel()
            await asyncio.gather(*state.background, return_exceptions=True)
            if state.service is not None:
                await state.service.scheduler.stop()
                if state.service.importer is not None:
                    await state.service.importer.close()  # its pooled KV connections
            if state.exporter is not None:
                await state.exporter.close()

    routes = [
        Route("/health", health),
        *probe_routes(live, ready, metrics_endpoint),
        Route("/v1/models", endpoints.models),
        Route("/v1/completions", endpoints.completions, methods=["POST"]),
        Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
        Route(RELEASE_PATH, release_kv, methods=["POST"]),
    ]
    middleware = [Middleware(RequestIdMiddleware, metrics=metrics), Middleware(BearerTokenMiddleware, token=api_token)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
    app.state.server = state
    return app


COUNTED_PATHS = frozenset(
    {"/health", "/health/live", "/health/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}
    | {RELEASE_PATH}
)


class RequestIdMiddleware:
    """Gives every request an id (X-Request-Id, taken from the client's if sent), counts answers, logs /v1 calls."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        bound = bind_request_id(request_id)
        trace.get_current_span().set_attribute("pdserve.request_id", request_id)
        path: str = scope["path"]
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            endpoint = path if path in COUNTED_PATHS else "other"  # a label from a fixed set, never the client's path
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if path.startswith("/v1/"):
                log.info(
                    "http request",
                    extra={
                        "request_id": request_id,
                        "path": path[:256],
                        "status": status,
                        "seconds": round(time.perf_counter() - started, 4),
                    },
                )
            reset_request_id(bound)
