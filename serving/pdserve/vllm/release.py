"""`POST /v1/kv/release` on a vLLM prefill (the contract: pdserve.kv.release), as API-server middleware:
`--middleware pdserve.vllm.release.KVReleaseMiddleware`, which pdstack renders for every prefill with
PdstackConnector.

The lease lives in the connector's worker processes (pdserve.vllm.producer's store, served by their KV servers), not
in the API server. The middleware frees it the way decode does after a pull: an ACK over the KV channel, with the
channel key and TLS settings of the engine's own kv_connector_extra_config, to this instance's own KV ports only
(every rank of every DP engine: a lease is on the ranks of the engine that prefilled it; the others answer
not held). It never connects where a request says.

vLLM adds user middleware outside its own, so the request reaches this one before vLLM's API-key check: the check
is vLLM's own (`verify_token` of the AuthenticationMiddleware it built from --api-key or VLLM_API_KEY), and an
engine started without an API key answers 403 here rather than release leases to anyone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve import jsonbody
from pdserve.common.kv_tls import RotatingContext
from pdserve.kv import KVMetrics, KVTransferError, ack
from pdserve.kv.release import MAX_BODY_BYTES, RELEASE_PATH, answer, lease_to_release
from pdserve.vllm.settings import ConnectorSettings, kv_ports_used

log = logging.getLogger(__name__)
MIDDLEWARE = f"{__name__}.KVReleaseMiddleware"  # what `--middleware` names
WILDCARD_HOSTS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}  # noqa: S104 (what a wildcard bind reaches)


@dataclass(frozen=True)
class _OwnKV:
    """Where this engine's KV servers listen and how to reach them, from its kv_connector_extra_config."""

    settings: ConnectorSettings
    ports: range
    tls: RotatingContext | None
    # The API server's default registry holds vLLM's pdserve_kv_* series (pdserve.vllm.stats); the worker that frees
    # the lease counts the release there, so the middleware's own connection counts stay private.
    metrics: KVMetrics = field(default_factory=lambda: KVMetrics(CollectorRegistry()))

    async def ack(self, port: int, request_id: str) -> bool:
        s = self.settings
        try:
            return await ack(
                WILDCARD_HOSTS.get(s.bind_host, s.bind_host),
                port,
                request_id,
                key=s.key,
                ssl_context=self.tls,
                server_hostname=s.kv_tls_server_name or s.advertise_host,
                connect_timeout_s=s.kv_connect_timeout_seconds,
                read_timeout_s=s.kv_read_timeout_seconds,
                retries=0,
                metrics=self.metrics,
            )
        except KVTransferError as error:
            raise KVTransferError(error.cause, f"port {port}: {error.message}") from None


class KVReleaseMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._authentication = _vllm_authentication(app)
        self._own: _OwnKV | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != RELEASE_PATH:
            await self.app(scope, receive, send)
            return
        response = await self._release(scope, receive)
        await response(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        if scope["method"] != "POST":
            return _error(405, "method: only POST releases a lease", "method")
        if self._authentication is None:
            return _error(403, "authorization: this engine has no API key (--api-key), so it releases no lease", None)
        if not self._authentication.verify_token(Headers(scope=scope)):
            return JSONResponse({"error": "Unauthorized"}, 401)  # as vLLM answers every other /v1 path
        return None

    async def _release(self, scope: Scope, receive: Receive) -> JSONResponse:
        if (refusal := self._refusal(scope)) is not None:
            return refusal
        try:
            own = self._own_kv(scope)
            request_id = lease_to_release(
                jsonbody.loads(await jsonbody.read_body(Request(scope, receive), MAX_BODY_BYTES))
            )
        except LookupError as error:
            return _error(404, f"path: {error}", "path")
        except jsonbody.BodyError as error:
            return _error(error.status, str(error), error.field)
        outcomes = await asyncio.gather(*(own.ack(port, request_id) for port in own.ports), return_exceptions=True)
        answered = [outcome for outcome in outcomes if isinstance(outcome, bool)]
        if not answered:
            log.warning("pdstack connector: release of lease %s: no KV port answered: %s", request_id, outcomes[0])
            return _error(502, f"kv: no KV port of this engine answered ({outcomes[0]})", None)
        return JSONResponse(answer(request_id, any(answered)))

    def _own_kv(self, scope: Scope) -> _OwnKV:
        if self._own is None:
            config = scope["app"].state.vllm_config
            transfer = config.kv_transfer_config
            if transfer is None or transfer.kv_connector != "PdstackConnector" or transfer.kv_role != "kv_producer":
                raise LookupError("this engine holds no PdstackConnector KV leases (only a prefill does)")
            parallel = config.parallel_config
            settings = ConnectorSettings.of(
                dict(transfer.kv_connector_extra_config or {}), producer=True, engine_id=str(transfer.engine_id)
            )
            used = kv_ports_used(int(parallel.tensor_parallel_size), int(parallel.data_parallel_size))
            self._own = _OwnKV(settings, range(settings.kv_port, settings.kv_port + used), settings.client_tls())
        return self._own


def _vllm_authentication(app: ASGIApp) -> Any:
    """The AuthenticationMiddleware vLLM placed inside this one (it is built inside-out), or None without an API key."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware  # noqa: PLC0415 (vLLM only)

    inner: Any = app
    while inner is not None:
        if isinstance(inner, AuthenticationMiddleware):
            return inner
        inner = getattr(inner, "app", None)
    return None


def _error(status: int, message: str, param: str | None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": status}}, status
    )
