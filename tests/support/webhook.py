"""An HTTP receiver standing in for the operator's pager: what Alertmanager's webhook receivers post to, in
tests/alerting and tests/local."""

from __future__ import annotations

import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY = 1 << 20  # Alertmanager's payloads here are a few KiB

Payload = dict[str, Any]


class Webhook:
    """An HTTP receiver on loopback taking Alertmanager's webhook POSTs at /hook/<token> only (the token is the
    credential a webhook URL carries); anything else is refused before its body is read."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.token = secrets.token_urlsafe(16)
        self.payloads: list[Payload] = []
        self.refused = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/hook/{self.token}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 5  # seconds a client may take to send its request

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or -1)
                if self.path != f"/hook/{hook.token}" or not 0 <= length <= MAX_BODY:
                    with hook._lock:
                        hook.refused += 1
                    self.send_error(404 if self.path != f"/hook/{hook.token}" else 413)
                    return
                payload = json.loads(self.rfile.read(length))
                with hook._lock:
                    hook.payloads.append(payload)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def start(self) -> Webhook:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def received(self) -> list[Payload]:
        with self._lock:
            return list(self.payloads)

    def alerts(self, alertname: str, **labels: str) -> list[tuple[str, Payload]]:
        """(receiver, alert) of every delivered alert with that name and labels, in arrival order."""
        return [
            (p["receiver"], a)
            for p in self.received()
            for a in p["alerts"]
            if a["labels"].get("alertname") == alertname and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def wait_for(
        self, alertname: str, count: int = 1, timeout: float = 30.0, **labels: str
    ) -> list[tuple[str, Payload]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.alerts(alertname, **labels)
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise AssertionError(f"{count} x {alertname} {labels} not delivered within {timeout} s; got {self.received()}")
