"""The scheduler's HTTP API.

Every endpoint but health and metrics needs `Authorization: Bearer <token>`: the admin token, or a principal token
derived from the identity key (pdserve.scheduler.identity). 401 without a valid token, 403 for a valid token of a
principal the endpoint does not serve.

Instances:  POST /v1/instances (register; principal instance:<body.instance_id>)
            POST /v1/instances/{id}/heartbeat  POST /v1/instances/{id}/drain  DELETE /v1/instances/{id}
            (principal instance:{id}, or admin)
            GET /v1/instances/{id} (principal instance:{id}, gateway, or admin: a node reads its own entry, e.g. to
            wait until it is routed or, draining, idle, without the gateway's token)
Gateways:   GET /v1/routing (ETag; If-None-Match answers 304)  GET /v1/instances  GET /v1/advice
            GET /v1/admin/weights (principal gateway, or admin)
Nodes:      POST /v1/join (no token: a signed sts:GetCallerIdentity buys the node's own instance token; only when
            join_node_roles is set, pdserve.scheduler.join)
Operators:  PUT /v1/admin/weights (admin only)
            POST /v1/admin/canary/verdicts (admin only: the deploy records each canary step's verdict)
Health:     /health/live  /health/ready  /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve import jsonbody
from pdserve.common.logs import RequestIdLogContext
from pdserve.common.routes import probe_routes

from .advisor import Advice, advise
from .client import read_token
from .identity import GATEWAY, instance_principal, principal_of
from .join import Joiner, JoinRefused
from .metrics import SchedulerMetrics
from .protocol import JOIN_PATH, CanaryVerdict, Heartbeat, InstanceInfo, JoinRequest, RoutingTable, WeightsUpdate
from .registry import Registry, UnknownInstanceError
from .settings import SchedulerSettings
from .weights import WeightsError, WeightsStore

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[Request], Awaitable[Response]]


def error(status: int, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field}}, status_code=status)


def validation_error(exc: ValidationError) -> JSONResponse:
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    return error(400, f"{field}: {first['msg']}", field)


async def parse_body(request: Request, model: type[M]) -> M | JSONResponse:
    try:
        raw = await jsonbody.read_body(request, state_of(request).settings.max_body_bytes)
        payload = jsonbody.loads(raw or b"{}")
    except jsonbody.BodyError as exc:
        return error(exc.status, str(exc), exc.field)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        return validation_error(exc)


ADMIN = "admin"


class SchedulerState:
    """Everything the handlers share: registry, weights, admin token, metrics."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.admin_token = read_token(settings.admin_token_file, "admin_token_file")
        self.identity_key = read_token(settings.identity_key_file, "identity_key_file")
        if hmac.compare_digest(self.admin_token.encode(), self.identity_key.encode()):
            raise ValueError(
                "identity_key_file holds the admin token: whoever can mint node tokens could then change the weights"
            )
        self.weights = WeightsStore(settings.state_file)
        self.weights_generation = 0
        self.boot_id = uuid.uuid4().hex[:8]
        self.registry = Registry(
            settings.dead_after(),
            settings.forget_dead_after,
            on_transition=lambda state: self.metrics.transitions.labels(state).inc(),
        )
        self.metrics = SchedulerMetrics(self.registry, lambda: self.weights.weights, self.advice)
        self.joiner = Joiner(settings, self.identity_key) if settings.join_node_roles else None

    def advice(self) -> Advice:
        s = self.settings
        return advise(
            self.registry.in_state("ready"), s.target_utilisation, s.scale_up_utilisation, s.scale_down_utilisation
        )

    def etag(self) -> str:
        return f'"{self.boot_id}-{self.registry.generation + self.weights_generation}"'

    def routing_table(self) -> RoutingTable:
        return RoutingTable(
            generation=self.registry.generation + self.weights_generation,
            weights=self.weights.weights,
            instances=[i.routed() for i in self.registry.in_state("ready")],
        )

    def principal(self, request: Request) -> str | None:
        """ "admin", the principal of a valid derived token, or None (no token, or one nobody was given)."""
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            return None
        if hmac.compare_digest(presented.encode(), self.admin_token.encode()):
            return ADMIN
        return principal_of(self.identity_key, presented)


def state_of(request: Request) -> SchedulerState:
    state: SchedulerState = request.app.state.scheduler
    return state


Allowed = Callable[[Request], frozenset[str]]


def guarded(endpoint: str, allowed: Allowed, handler: Handler) -> Handler:
    """Run `handler` only for a caller whose principal is in `allowed(request)` (admin always is).

    Refusals are decided before the body is read, and counted by endpoint and reason: a stranger who could register
    would be sent prompts, one who could drain or deregister could take the fleet out of service, and one who
    could read the routing table would learn every server's address.
    """

    async def checked(request: Request) -> Response:
        state = state_of(request)
        principal = state.principal(request)
        if principal is None:
            reason = "invalid_token" if request.headers.get("authorization") else "missing_token"
            state.metrics.unauthorized.labels(endpoint, reason).inc()
            return error(401, f"{endpoint} needs Authorization: Bearer <token>", "authorization")
        if principal != ADMIN and principal not in allowed(request):
            state.metrics.unauthorized.labels(endpoint, "forbidden").inc()
            return error(403, f"{endpoint} is not open to principal {principal}", "authorization")
        request.state.principal = principal
        return await handler(request)

    return checked


def path_instance(request: Request) -> frozenset[str]:
    return frozenset({instance_principal(request.path_params["instance_id"])})


def path_instance_or_gateway(request: Request) -> frozenset[str]:
    return path_instance(request) | gateway(request)


def gateway(request: Request) -> frozenset[str]:
    return frozenset({GATEWAY})


def admin_only(request: Request) -> frozenset[str]:
    return frozenset()


def any_principal(request: Request) -> frozenset[str]:
    """For register, whose principal depends on the body: checked against instance_id once the body is parsed."""
    principal = state_of(request).principal(request)
    return frozenset({principal} if principal and principal.startswith("instance:") else ())


async def register(request: Request) -> Response:
    info = await parse_body(request, InstanceInfo)
    if isinstance(info, JSONResponse):
        return info
    state = state_of(request)
    if info.instance_id is None:
        return error(400, "instance_id: required (the caller's token is bound to it)", "instance_id")
    principal = request.state.principal
    if principal not in (ADMIN, instance_principal(info.instance_id)):
        state.metrics.unauthorized.labels("register", "forbidden").inc()
        return error(403, f"principal {principal} may not register instance {info.instance_id}", "instance_id")
    instance = state.registry.register(info)
    return JSONResponse(
        {
            "instance_id": instance.instance_id,
            "state": instance.state,
            "heartbeat_interval": state.settings.heartbeat_interval,
        },
        status_code=201,
    )


async def heartbeat(request: Request) -> Response:
    beat = await parse_body(request, Heartbeat)
    if isinstance(beat, JSONResponse):
        return beat
    state = state_of(request)
    try:
        instance = state.registry.heartbeat(request.path_params["instance_id"], beat.load)
    except UnknownInstanceError:
        state.metrics.heartbeats.labels("unknown").inc()
        return error(404, "unknown instance: register again", "instance_id")
    state.metrics.heartbeats.labels("ok").inc()
    return JSONResponse({"instance_id": instance.instance_id, "state": instance.state})


async def drain(request: Request) -> Response:
    try:
        instance = state_of(request).registry.drain(request.path_params["instance_id"])
    except UnknownInstanceError:
        return error(404, "unknown instance", "instance_id")
    return JSONResponse({"instance_id": instance.instance_id, "state": instance.state})


async def deregister(request: Request) -> Response:
    try:
        state_of(request).registry.remove(request.path_params["instance_id"])
    except UnknownInstanceError:
        return error(404, "unknown instance", "instance_id")
    return Response(status_code=204)


async def get_instance(request: Request) -> Response:
    instance = state_of(request).registry.find(request.path_params["instance_id"])
    if instance is None:
        return error(404, "unknown instance", "instance_id")
    return JSONResponse(instance.routed().model_dump())


async def list_instances(request: Request) -> Response:
    instances = [i.routed().model_dump() for i in state_of(request).registry.all()]
    return JSONResponse({"instances": instances})


async def routing(request: Request) -> Response:
    state = state_of(request)
    etag = state.etag()
    if request.headers.get("if-none-match") == etag:
        state.metrics.table_polls.labels("not_modified").inc()
        return Response(status_code=304, headers={"ETag": etag})
    state.metrics.table_polls.labels("changed").inc()
    return JSONResponse(state.routing_table().model_dump(), headers={"ETag": etag})


async def advice(request: Request) -> Response:
    return JSONResponse(state_of(request).advice().model_dump())


async def get_weights(request: Request) -> Response:
    return JSONResponse({"weights": state_of(request).weights.weights})


async def put_weights(request: Request) -> Response:
    state = state_of(request)
    update = await parse_body(request, WeightsUpdate)
    if isinstance(update, JSONResponse):
        state.metrics.admin_requests.labels("invalid").inc()
        return update
    try:
        state.weights.set(update.weights)
    except WeightsError as exc:
        state.metrics.admin_requests.labels("invalid").inc()
        return error(400, str(exc), "weights")
    state.weights_generation += 1
    state.metrics.admin_requests.labels("ok").inc()
    log.info("weights set", extra={"fields": {"weights": update.weights}})
    return JSONResponse({"weights": state.weights.weights})


async def record_verdict(request: Request) -> Response:
    state = state_of(request)
    verdict = await parse_body(request, CanaryVerdict)
    if isinstance(verdict, JSONResponse):
        return verdict
    state.metrics.canary_verdicts.labels(verdict.canary, verdict.baseline, verdict.outcome).inc()
    state.metrics.canary_step.labels(verdict.canary).set(verdict.step_percent)
    log.info("canary verdict recorded", extra={"fields": verdict.model_dump()})
    return JSONResponse(verdict.model_dump())


# A signed GetCallerIdentity is under 4 KiB; the join's body is read before anything authenticates it.
JOIN_MAX_BODY_BYTES = 16_384


async def join(request: Request) -> Response:
    """A node's signed sts:GetCallerIdentity for its own instance token (pdserve.scheduler.join)."""
    state = state_of(request)
    joiner = state.joiner
    assert joiner is not None  # the route exists only with join_node_roles
    if joiner.in_flight >= state.settings.join_max_concurrent:
        state.metrics.joins.labels("busy").inc()
        return JSONResponse(
            {"error": {"message": "too many joins at once: retry", "field": None}},
            status_code=429,
            headers={"Retry-After": "1"},
        )
    joiner.in_flight += 1
    try:
        parsed = await parse_join(request)
        forwarded = joiner.check(parsed)
        answer = joiner.answer(await joiner.caller(parsed, forwarded), parsed.engine_id)
    except JoinRefused as exc:
        state.metrics.joins.labels(exc.reason).inc()
        log.debug("join refused", extra={"fields": {"reason": exc.reason, "field": exc.field}})
        return error(exc.status, str(exc), exc.field)
    finally:
        joiner.in_flight -= 1
    state.metrics.joins.labels("ok").inc()
    log.info("node joined", extra={"fields": {"instance_id": answer.instance_id}})
    return JSONResponse(answer.model_dump())


async def parse_join(request: Request) -> JoinRequest:
    """The join's body, at most JOIN_MAX_BODY_BYTES; JoinRefused naming the field otherwise."""
    limit = min(JOIN_MAX_BODY_BYTES, state_of(request).settings.max_body_bytes)
    try:
        payload = jsonbody.loads(await jsonbody.read_body(request, limit) or b"{}")
    except jsonbody.BodyError as exc:
        raise JoinRefused(exc.status, "body", exc.field, str(exc)) from None
    try:
        return JoinRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        reason = "engine_id" if field == "engine_id" else "body"
        raise JoinRefused(400, reason, field, f"{field}: {first['msg']}") from None


async def no_route(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    if status == 405:
        return error(405, f"method: {request.method} is not allowed on {request.url.path}", "method")
    return error(404, f"path: no endpoint at {request.url.path}", "path")


async def live(request: Request) -> Response:
    return JSONResponse({"status": "live"})


async def ready(request: Request) -> Response:
    return JSONResponse({"status": "ready", "generation": state_of(request).registry.generation})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(state_of(request).metrics.prometheus), media_type=CONTENT_TYPE_LATEST)


async def sweep_forever(state: SchedulerState) -> None:
    period = min(1.0, state.settings.heartbeat_interval / 2)
    while True:
        await asyncio.sleep(period)
        state.registry.sweep()


def create_app(settings: SchedulerSettings) -> Starlette:
    state = SchedulerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        sweeper = asyncio.create_task(sweep_forever(state))
        try:
            yield {}
        finally:
            sweeper.cancel()
            if state.joiner is not None:
                await state.joiner.aclose()

    routes = [
        Route("/v1/instances", guarded("register", any_principal, register), methods=["POST"]),
        Route("/v1/instances", guarded("list_instances", gateway, list_instances), methods=["GET"]),
        Route(
            "/v1/instances/{instance_id}/heartbeat", guarded("heartbeat", path_instance, heartbeat), methods=["POST"]
        ),
        Route("/v1/instances/{instance_id}/drain", guarded("drain", path_instance, drain), methods=["POST"]),
        Route("/v1/instances/{instance_id}", guarded("deregister", path_instance, deregister), methods=["DELETE"]),
        Route(
            "/v1/instances/{instance_id}",
            guarded("get_instance", path_instance_or_gateway, get_instance),
            methods=["GET"],
        ),
        Route("/v1/routing", guarded("routing", gateway, routing), methods=["GET"]),
        Route("/v1/advice", guarded("advice", gateway, advice), methods=["GET"]),
        Route("/v1/admin/weights", guarded("get_weights", gateway, get_weights), methods=["GET"]),
        Route("/v1/admin/weights", guarded("put_weights", admin_only, put_weights), methods=["PUT"]),
        Route("/v1/admin/canary/verdicts", guarded("record_verdict", admin_only, record_verdict), methods=["POST"]),
        *([Route(JOIN_PATH, join, methods=["POST"])] if state.joiner is not None else []),
        *probe_routes(live, ready, metrics),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: no_route, 405: no_route},
        middleware=[Middleware(RequestIdLogContext)],
    )
    app.state.scheduler = state
    return app
