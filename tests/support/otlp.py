"""An OTLP/HTTP traces endpoint for tests: a real HTTP server that checks the exporter's bearer token (when given)
before it reads, bounds the body, and decodes the protobuf with opentelemetry-proto's own classes."""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_EXPORT_BYTES = 8 << 20


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent: str
    name: str
    kind: int
    attributes: dict[str, Any]


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    spans: list[Span] = field(default_factory=list)
    exports: dict[str, int] = field(default_factory=dict)  # path -> accepted export requests
    refused: int = 0

    def url(self, path: str = "/v1/traces") -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}{path}"

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            spans += [
                Span(
                    str(resource.get("service.name")),
                    s.trace_id.hex(),
                    s.span_id.hex(),
                    s.parent_span_id.hex(),
                    s.name,
                    s.kind,
                    {a.key: _value(a.value) for a in s.attributes},
                )
                for s in scope_spans.spans
            ]
    return spans


@contextlib.contextmanager
def receiving(host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> Iterator[Receiver]:
    """A receiver listening on host:port until the block ends."""
    state: dict[str, Receiver] = {}

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # seconds a client may take to send its request

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            authorized = token is None or self.headers.get("Authorization") == f"Bearer {token}"
            if not authorized or not 0 < length <= MAX_EXPORT_BYTES:
                state["r"].refused += 1
                self.send_response(401 if length <= MAX_EXPORT_BYTES else 413)
                self.end_headers()
                return
            body = self.rfile.read(length)
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            state["r"].spans += decode(body)
            state["r"].exports[self.path] = state["r"].exports.get(self.path, 0) + 1
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    state["r"] = Receiver(server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["r"]
    finally:
        server.shutdown()
        server.server_close()
