"""One log schema for every pdserve component: JSON lines, one object per record.

    {"time": "2026-12-01T18:40:29.123Z", "level": "info", "component": "gateway", "logger": "pdserve.gateway.app",
     "message": "request", "request_id": "...", "trace_id": "...", "span_id": "...", ...extra fields}

The request id comes from the record (`extra={"request_id": ...}`), else from the request being handled
(`bind_request_id`, set by each component's request middleware); trace and span ids from the current OpenTelemetry
span. Outside a request, and with tracing off, they are null. Extra fields are passed either as
`extra={"fields": {...}}` or as plain `extra={...}` keys; they never override the fixed keys above.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from typing import Any

from opentelemetry import trace
from starlette.types import ASGIApp, Receive, Scope, Send

FIXED = ("time", "level", "component", "logger", "message", "request_id", "trace_id", "span_id")
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "fields"}
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)


def bind_request_id(request_id: str | None) -> contextvars.Token[str | None]:
    """Make `request_id` the id of every line logged from this context (and tasks started from it)."""
    return _request_id.set(request_id)


def reset_request_id(token: contextvars.Token[str | None]) -> None:
    _request_id.reset(token)


def current_request_id() -> str | None:
    return _request_id.get()


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            extra.update(fields)
        span = trace.get_current_span().get_span_context()
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": extra.pop("request_id", None) or _request_id.get(),
            "trace_id": trace.format_trace_id(span.trace_id) if span.is_valid else None,
            "span_id": trace.format_span_id(span.span_id) if span.is_valid else None,
        }
        entry.update({k: v for k, v in extra.items() if k not in FIXED})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(component: str, level: str) -> None:
    """Send every log record of the process to stderr in the one schema."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("httpx").setLevel(logging.WARNING)


def request_id_of(scope: Scope) -> str:
    """The caller's X-Request-Id when it is a plain token, else a new one."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            incoming = bytes(value).decode("latin-1")
            if REQUEST_ID.fullmatch(incoming):
                return incoming
    return uuid.uuid4().hex


class RequestIdLogContext:
    """ASGI middleware binding each HTTP request's id (its X-Request-Id, or a new one) to the lines it logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = bind_request_id(request_id_of(scope))
        try:
            await self.app(scope, receive, send)
        finally:
            reset_request_id(token)
