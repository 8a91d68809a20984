"""TLS for the KV channel: prefill's listener and decode's pulls, on the channel's own threads.

The HTTP listeners' contexts (pdserve.common.tls) are reloaded in place by RELOADER on the event loop thread that also
runs their handshakes. The KV channel makes its handshakes on connection threads, and vLLM's processes run no
reloading loop, so its contexts are RotatingContexts: rebuilt whole from their files when those change, and swapped
in between handshakes.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pdserve.common.tls import FileStamp, TLSFileError, file_stamp, load_ca, load_pair

log = logging.getLogger("pdserve.tls")


class SocketWrapper(Protocol):
    """What the KV channel's threads make handshakes with: an ssl.SSLContext, or a RotatingContext."""

    def wrap_socket(
        self,
        sock: socket.socket,
        server_side: bool = ...,
        do_handshake_on_connect: bool = ...,
        server_hostname: str | None = ...,
    ) -> ssl.SSLSocket: ...


class RotatingContext:
    """An SSLContext rebuilt when its files change, for threads that make handshakes (the KV channel's connection
    threads, and vLLM's processes, which run no reloading loop): each handshake takes the newest context, and a
    rebuild swaps a new one in, so no handshake ever sees a context being modified (`RELOADER` modifies contexts
    in place, which is safe only on the event loop thread that also runs their handshakes). The files' identity is
    checked at most every `check_seconds`, on the handshake path; a pair that cannot be loaded yet (half written)
    keeps the previous context until it can."""

    def __init__(self, role: str, build: Callable[[], ssl.SSLContext], files: list[Path], check_seconds: float) -> None:
        self.role, self._build, self._files, self._check_seconds = role, build, files, check_seconds
        self._lock = threading.Lock()
        self._stamp = file_stamp(files)
        self._context = build()
        self._next_check = time.monotonic() + check_seconds
        self._failed: tuple[FileStamp, ...] = ()

    def current(self) -> ssl.SSLContext:
        if time.monotonic() >= self._next_check:
            with self._lock:
                if time.monotonic() >= self._next_check:
                    self._next_check = time.monotonic() + self._check_seconds
                    self._rebuild_if_changed()
        return self._context

    def wrap_socket(
        self,
        sock: socket.socket,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        server_hostname: str | None = None,
    ) -> ssl.SSLSocket:
        return self.current().wrap_socket(
            sock,
            server_side=server_side,
            server_hostname=server_hostname,
            do_handshake_on_connect=do_handshake_on_connect,
        )

    def _rebuild_if_changed(self) -> None:
        stamp = file_stamp(self._files)
        if stamp == self._stamp:
            return
        fields = {"role": self.role, "files": [str(path) for path in self._files]}
        try:
            context = self._build()
        except (TLSFileError, OSError, ssl.SSLError) as error:
            if stamp != self._failed:
                self._failed = stamp
                log.warning(
                    "TLS files changed but cannot be loaded yet; handshakes keep the previous certificate",
                    extra={"fields": {**fields, "cause": str(error)}},
                )
            return
        self._context, self._stamp, self._failed = context, stamp, ()
        log.info("TLS certificate reloaded", extra={"fields": fields})


def kv_server_context(cert: Path, key: Path, ca: Path | None, check_seconds: float) -> RotatingContext:
    """Prefill's KV listener (TLS 1.2+), rebuilt when its files change; with `ca`, a puller must present a
    certificate it signed (the channel's HMAC stays the caller's proof of identity either way)."""

    def build() -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if ca is not None:
            load_ca(context, ca, "kv_tls_ca")
            context.verify_mode = ssl.CERT_REQUIRED
        load_pair(context, cert, key, "kv_tls_cert", "kv_tls_key")
        return context

    return RotatingContext("kv-server", build, [p for p in (cert, key, ca) if p is not None], check_seconds)


def kv_client_context(ca: Path, cert: Path | None, key: Path | None, check_seconds: float) -> RotatingContext:
    """Decode's KV pulls: prefill's certificate must chain to `ca` and name the host pulled from (or the configured
    server name); presents `cert` when given. Rebuilt when its files change."""

    def build() -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        load_ca(context, ca, "kv_tls_ca")
        if cert is not None and key is not None:
            load_pair(context, cert, key, "kv_tls_cert", "kv_tls_key")
        return context

    return RotatingContext("kv-client", build, [p for p in (ca, cert, key) if p is not None], check_seconds)
