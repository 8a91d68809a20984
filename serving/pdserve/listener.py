"""Every pdserve HTTP listener: uvicorn with bounds on slow clients.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and caps an incomplete header block
(`h11_max_incomplete_event_size`), but it waits forever for a request line and headers that trickle in, and for a body
that never completes. `BoundedH11Protocol` adds both deadlines on uvicorn's h11 protocol, where the connection state
is known:

- header deadline: armed when a connection opens and after each response; request line and headers must be complete
  before it fires, however the bytes are spaced;
- header size: a request line and headers over the cap get 400 and the connection is closed, however they arrive;
- body deadline: armed when a request's headers are complete; its body must be complete before it fires (also when
  the application answered early, e.g. 401 before reading the body). A request whose body is late gets 408 if the
  application has not started its response; the connection is closed either way.

The limits come from the environment (serving/README.md): PDSERVE_HTTP_HEADER_TIMEOUT_SECONDS (10),
PDSERVE_HTTP_BODY_TIMEOUT_SECONDS (30), PDSERVE_HTTP_IDLE_TIMEOUT_SECONDS (keep-alive idle, 5),
PDSERVE_HTTP_MAX_HEADER_BYTES (65536).

With a certificate in the component's TLS settings (pdserve.common.tls) the listener serves TLS only: a plaintext
request fails its handshake, and under tls_client_auth required so does a client without a certificate from
tls_ca. Probes (/health...) are on the same listener. The certificate is reloaded in place when its files change
or on SIGHUP (pdserve.common.tls.reloading), without a restart. A TLS handshake must be complete within the header
deadline too (asyncio's ssl_handshake_timeout; its default would be 60 s); the header deadline then starts afresh.
A TLS connection being closed waits at most TLS_SHUTDOWN_TIMEOUT_S for the peer's close_notify (asyncio's
ssl_shutdown_timeout, 30 s by default): an idle pooled client never sends one, so with the default every stop of a
TLS listener with a keep-alive caller took 30 s, past a container's stop grace.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import h11
import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.common import tls
from pdserve.common.tracing import instrument_app

logger = logging.getLogger("pdserve.listener")

HEADER_TIMEOUT_ENV = "PDSERVE_HTTP_HEADER_TIMEOUT_SECONDS"
BODY_TIMEOUT_ENV = "PDSERVE_HTTP_BODY_TIMEOUT_SECONDS"
IDLE_TIMEOUT_ENV = "PDSERVE_HTTP_IDLE_TIMEOUT_SECONDS"
MAX_HEADER_BYTES_ENV = "PDSERVE_HTTP_MAX_HEADER_BYTES"
TLS_SHUTDOWN_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ListenerLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    max_header_bytes: int = 65536

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ListenerLimits:
        env = os.environ if env is None else env
        default = cls()
        return cls(
            header_timeout=_positive(env, HEADER_TIMEOUT_ENV, default.header_timeout, float),
            body_timeout=_positive(env, BODY_TIMEOUT_ENV, default.body_timeout, float),
            idle_timeout=_positive(env, IDLE_TIMEOUT_ENV, default.idle_timeout, float),
            max_header_bytes=int(_positive(env, MAX_HEADER_BYTES_ENV, default.max_header_bytes, int)),
        )


def _positive(env: Mapping[str, str], name: str, default: float, kind: type) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: not a number") from None
    if not value > 0:
        raise SystemExit(f"{name}={raw!r}: must be greater than 0")
    return float(value)


REQUEST_TIMEOUT_BODY = b"request body not received in time\n"


class _CappedConnection(h11.Connection):
    """h11's server side, refusing a request whose line and headers exceed `max_header_bytes`. h11's own cap
    (max_incomplete_event_size) only holds while the header block is incomplete: one that arrives in a single read
    of any size is parsed whole."""

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request) and _header_bytes(event) > self.max_header_bytes:
            raise h11.RemoteProtocolError("request headers too large", error_status_hint=431)
        return event


def _header_bytes(request: h11.Request) -> int:
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a body deadline (see the module docstring)."""

    limits: ClassVar[ListenerLimits] = ListenerLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _CappedConnection(self.limits.max_header_bytes)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._sync_deadlines()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header()
        self._cancel_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_deadlines()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_deadlines()

    def _sync_deadlines(self) -> None:
        """Arm or disarm the deadlines from where the client is in its request (h11's view of it)."""
        if self.transport.is_closing():
            self._cancel_header()
            self._cancel_body()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            self._cancel_body()
            if self._header_timer is None:  # an absolute deadline: bytes arriving do not push it back
                self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timed_out)
        elif state is h11.SEND_BODY:
            self._cancel_header()
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_timeout, self._body_timed_out)
        else:
            self._cancel_header()
            self._cancel_body()

    def _cancel_header(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            logger.debug("closing %s: request headers not complete within %ss", self.client, self.limits.header_timeout)
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        logger.debug("closing %s: request body not complete within %ss", self.client, self.limits.body_timeout)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            self._send_408()
        if cycle is not None:  # the application sees http.disconnect from now on, and its sends go nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _send_408(self) -> None:
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"connection", b"close"),
            (b"content-length", str(len(REQUEST_TIMEOUT_BODY)).encode()),
        ]
        try:
            self.transport.write(
                self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")) or b""
            )
            self.transport.write(self.conn.send(h11.Data(data=REQUEST_TIMEOUT_BODY)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            pass  # h11 refused the early response; closing is enough


class _QuietDisconnect:
    """The application, except that a request whose client went away (or was cut off by a deadline) while the
    application read its body ends without uvicorn's "Exception in ASGI application" traceback."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = False

        async def watched_receive() -> Any:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        try:
            await self.app(scope, watched_receive, send)
        except ClientDisconnect:
            if not gone:
                raise
            logger.debug("client of %s %s disconnected before its body was complete", scope["method"], scope["path"])


def bounded_protocol(limits: ListenerLimits) -> type[BoundedH11Protocol]:
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})


def uvicorn_options(limits: ListenerLimits) -> dict[str, Any]:
    """What uvicorn gets on every pdserve listener besides the app, host, port and log level."""
    return {
        "http": bounded_protocol(limits),
        "ws": "none",  # nothing serves websockets; an upgraded connection would leave these deadlines behind
        "timeout_keep_alive": limits.idle_timeout,  # uvicorn hands it to loop.call_later: float seconds work
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "log_config": None,
        "access_log": False,
    }


class _ReloadingServer(uvicorn.Server):
    """uvicorn's server, reloading this process's TLS certificates while it runs (on its loop)."""

    def __init__(self, config: uvicorn.Config, reload_seconds: float, handshake_timeout: float) -> None:
        super().__init__(config)
        self.reload_seconds = reload_seconds
        self.handshake_timeout = handshake_timeout

    async def serve(self, sockets: Any = None) -> None:
        async with tls.reloading(self.reload_seconds):
            await super().serve(sockets)

    async def startup(self, sockets: Any = None) -> None:
        if self.config.ssl is None:
            await super().startup(sockets)
            return
        # uvicorn passes create_server neither TLS timeout: shadow the loop's method while uvicorn binds, so that a
        # client stalling its handshake is dropped at the header deadline instead of after asyncio's 60 s, and a
        # closing connection waits TLS_SHUTDOWN_TIMEOUT_S for the peer's close_notify instead of 30 s.
        loop: Any = asyncio.get_running_loop()
        loop.create_server = functools.partial(
            loop.create_server,
            ssl_handshake_timeout=self.handshake_timeout,
            ssl_shutdown_timeout=TLS_SHUTDOWN_TIMEOUT_S,
        )
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server


def serve(
    app: Any,
    host: str,
    port: int,
    *,
    tls_settings: tls.TLSSettings | None = None,
    log_level: str | None = None,
    graceful_shutdown_seconds: int | None = None,
) -> None:
    """Run `app` on host:port until SIGINT/SIGTERM, with the slow-client bounds from the environment; over TLS
    when `tls_settings` has a certificate. A TLS file that cannot be used exits naming its setting."""
    settings = tls_settings or tls.TLSSettings()
    try:
        context = tls.server_context(settings)
    except tls.TLSFileError as error:
        raise SystemExit(f"pdserve: {error}") from None
    extra: dict[str, Any] = {}
    if context is not None:
        extra["ssl_context_factory"] = lambda _config, _default: context
    limits = ListenerLimits.from_env()
    config = uvicorn.Config(
        _QuietDisconnect(app),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_shutdown_seconds,
        **uvicorn_options(limits),
        **extra,
    )
    server = _ReloadingServer(config, settings.tls_reload_seconds, limits.header_timeout)
    server.run()
    if not server.started:
        sys.exit(3)  # uvicorn.run's exit status when startup fails (e.g. the port is taken)


class ComponentSettings(Protocol):
    """What serve_component reads of a component's settings (they are TLSSettings too)."""

    host: str
    port: int
    log_level: str


def serve_component(app: Any, settings: ComponentSettings, *, graceful_shutdown_seconds: int | None = None) -> None:
    """`serve` a component's app, traced (pdserve.common.tracing), on its settings' address, TLS and log level."""
    assert isinstance(settings, tls.TLSSettings)
    serve(
        instrument_app(app),
        settings.host,
        settings.port,
        tls_settings=settings,
        log_level=settings.log_level,
        graceful_shutdown_seconds=graceful_shutdown_seconds,
    )
