"""One place where every API request is counted, logged and taken off the in-flight gauge, whatever happens to it.

The handlers only fill in the request's Record (tenant, version, the status to count, the routing Context); this
ASGI middleware opens it, and closes it once the response, streamed or not, is over: on a 4xx, on a client that
went away, and on an exception no handler caught, which becomes a 500 whose body says nothing of the code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.common.logs import bind_request_id, request_id_of, reset_request_id

from .metrics import GatewayMetrics

log = logging.getLogger(__name__)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/models": "models"}
UNCOUNTED = ("/health", "/metrics")
CLIENT_CLOSED = 499


@dataclass
class Record:
    """What the log line and the request counter say about one request."""

    request_id: str
    endpoint: str
    started: float = field(default_factory=time.perf_counter)
    tenant: str = ""
    version: str = ""
    status: int | None = None
    """The status to count when it differs from the one sent: 499 for a client gone, 502 for a broken stream."""
    error: str = ""
    """the refused field, or the cause of a failure"""
    fields: dict[str, Any] = field(default_factory=dict)
    """more for the log line: route, instances, timings"""
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """run once the response is over, even if its body was never iterated (the client left first)"""
    dispatched: bool = False
    """the request reached routing: its duration goes into the latency histogram"""


def record_of(scope: Scope) -> Record:
    record: Record = scope["state"]["record"]
    return record


class Accounting:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, log_prompts: Callable[[Record], str | None]) -> None:
        self.app, self.metrics, self.log_prompts = app, metrics, log_prompts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(UNCOUNTED):
            await self.app(scope, receive, send)
            return
        record = Record(request_id_of(scope), ENDPOINTS.get(scope["path"], "other"))
        scope.setdefault("state", {})["record"] = record
        bound = bind_request_id(record.request_id)
        sent: list[int] = []

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])
                # the server span ends with the response's last byte, before the request is closed
                trace.get_current_span().set_attributes(
                    {
                        "pdserve.request_id": record.request_id,
                        "pdserve.tenant": record.tenant,
                        "pdserve.version": record.version,
                    }
                )
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", record.request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # gone before its body was complete (or cut off by the listener's body deadline)
            record.status, record.error = CLIENT_CLOSED, record.error or "client_closed"
        except Exception as exc:  # the one place an unexpected failure becomes a counted 500
            record.error = record.error or type(exc).__name__
            log.error("unhandled error", exc_info=True, extra={"fields": {"request_id": record.request_id}})
            if not sent:
                record.status = 500
                with contextlib.suppress(OSError):  # the client may be gone too
                    await _internal_error(send_with_id, record.request_id)
        finally:
            for cleanup in record.cleanups:
                await _quietly(cleanup)
            self.metrics.inflight.dec()
            self._close(record, record.status or (sent[0] if sent else CLIENT_CLOSED))
            reset_request_id(bound)

    def _close(self, record: Record, status: int) -> None:
        prompt = self.log_prompts(record)
        elapsed = time.perf_counter() - record.started
        self.metrics.requests.labels(record.endpoint, str(status), record.tenant, record.version).inc()
        if record.dispatched:
            self.metrics.e2e.labels(record.endpoint, record.version).observe(elapsed)
        fields: dict[str, Any] = {
            "request_id": record.request_id,
            "tenant": record.tenant,
            "endpoint": record.endpoint,
            "status": status,
            "version": record.version,
            "seconds": round(elapsed, 6),
            **record.fields,
        }
        if record.error:
            fields["error"] = record.error
        if prompt is not None:
            fields["prompt"] = prompt
        log.info("request", extra={"fields": fields})


async def _internal_error(send: Send, request_id: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"internal error (request {request_id})",
                "type": "internal_error",
                "param": None,
                "code": 500,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 500,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _quietly(cleanup: Callable[[], Awaitable[None]]) -> None:
    try:
        await cleanup()
    except Exception:  # a failed cleanup must not stop the accounting
        log.warning("cleanup failed", exc_info=True)
