"""The model-server API credential: a bearer token every caller but the probes must present.

Checked in an ASGI middleware on the request's headers alone, so a caller without the token is answered 401 before
a byte of its body is read (as vLLM's --api-key guards /v1/*).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})


class BearerTokenMiddleware:
    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode() if token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if hmac.compare_digest(presented, self._expected):
            await self.app(scope, receive, send)
            return
        problem = "missing" if not presented else "wrong"
        await _unauthorized(send, f"{problem} API token: send 'Authorization: Bearer <token>' (the server API token)")


async def _unauthorized(send: Send, message: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "authentication_error", "param": None, "code": 401}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
