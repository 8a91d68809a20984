"""How the decode side reaches a prefill server's KV port: connect, TLS, the HMAC handshake, with retries; and how
long its reads outwait a server that is silent while its TCP stack still answers (pdserve.kv.wire).

A refused or timed-out connect is made again `retries` times. A server at its cap of authenticated connections
answers `capacity` (pdserve.kv.admission): that connect is made again, with the same backoff doubling up to
MAX_BACKOFF_S, for up to `capacity_wait_s`, since connections free up as pulls end; a pull's transfer deadline (the
connector's transfer_timeout_seconds) bounds it too. Every connect made again is counted
(pdserve_kv_connect_retries{cause})."""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
import time
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.common.kv_tls import SocketWrapper
from pdserve.kv import auth
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics
from pdserve.kv.protocol import NONCE_BYTES, PROOF_BYTES, FrameType, expect
from pdserve.kv.threads import stream_threads
from pdserve.kv.wire import FrameSocket

# A server silent while its TCP stack answers (kept off the CPU: measured 13 s at load 16 on 2 cores, a TP 2 pair's
# prefill) is waited for this many read timeouts by default before the pull fails.
STALL_READ_TIMEOUTS = 4
CAPACITY_WAIT_S = 10.0  # how long a connect keeps trying a server that answers `capacity`
MAX_BACKOFF_S = 1.0  # the longest pause between two connects


@dataclass(frozen=True)
class Connector:
    """How to reach a prefill server's KV port: key, TLS, timeouts and connect retries."""

    key: auth.SecretKey
    ssl_context: SocketWrapper | None = None
    server_hostname: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.2
    # How long a read outwaits a server that sends nothing while its TCP stack still answers (pdserve.kv.wire);
    # None: STALL_READ_TIMEOUTS read timeouts.
    stall_timeout_s: float | None = None
    capacity_wait_s: float = CAPACITY_WAIT_S
    metrics: KVMetrics | None = None  # counts connects made again

    @property
    def stall_bound_s(self) -> float:
        return self.stall_timeout_s if self.stall_timeout_s is not None else STALL_READ_TIMEOUTS * self.read_timeout_s

    async def connect(self, host: str, port: int) -> FrameSocket:
        """Open an authenticated connection (see `connect_session`)."""
        channel, _session = await self.connect_session(host, port)
        return channel

    async def connect_session(self, host: str, port: int) -> tuple[FrameSocket, bytes]:
        """Open an authenticated connection (on a thread) and return it with its session key, retrying refused or
        timed-out connects and a server at capacity with exponential backoff (see the module's docstring)."""
        capacity_until = time.monotonic() + self.capacity_wait_s
        failures = 0  # refused or timed-out connects so far
        for attempt in itertools.count():
            future = stream_threads().submit(self.connect_blocking, host, port)
            try:
                return await asyncio.wrap_future(future)
            except KVTransferError as error:
                pause = self._pause_before_retry(error, attempt, failures, capacity_until)
                if pause is None:
                    raise
                failures += error.cause != "capacity"
                if self.metrics is not None:
                    self.metrics.observe_connect_retry(error.cause)
            except asyncio.CancelledError:
                future.add_done_callback(_close_unused)
                raise
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    def _pause_before_retry(
        self, error: KVTransferError, attempt: int, failures: int, capacity_until: float
    ) -> float | None:
        """How long to wait before connecting again after `error`, or None to give up."""
        pause: float = min(MAX_BACKOFF_S, self.backoff_s * 2.0**attempt)
        if error.cause == "capacity":
            left = capacity_until - time.monotonic()
            return min(pause, left) if left > 0 else None
        if error.cause in ("connection", "timeout") and failures < self.retries:
            return pause
        return None

    def connect_blocking(self, host: str, port: int) -> tuple[FrameSocket, bytes]:
        """One connect, TLS and HMAC handshake, on the calling thread."""
        try:
            sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
        except TimeoutError as error:
            raise KVTransferError(
                "timeout", f"connect to {host}:{port} took over {self.connect_timeout_s:g} s"
            ) from error
        except OSError as error:
            raise KVTransferError(
                "connection", f"cannot connect to {host}:{port}: {error.strerror or error}"
            ) from error
        channel = FrameSocket(sock)
        try:
            if self.ssl_context is not None:
                channel = FrameSocket(self._wrap(sock, host, port))
            channel.probe_peer(self.stall_bound_s)
            return channel, self._handshake(channel)
        except BaseException:
            channel.close()
            sock.close()
            raise

    def _wrap(self, sock: socket.socket, host: str, port: int) -> ssl.SSLSocket:
        assert self.ssl_context is not None
        try:
            # As asyncio did before (3594ff4): the name to verify defaults to the host connected to.
            return self.ssl_context.wrap_socket(sock, server_hostname=self.server_hostname or host)
        except ssl.SSLError as error:
            raise KVTransferError("auth", f"TLS handshake with {host}:{port} failed: {error.reason}") from error
        except TimeoutError as error:
            raise KVTransferError(
                "timeout", f"TLS handshake with {host}:{port} took over {self.connect_timeout_s:g} s"
            ) from error
        except OSError as error:
            raise KVTransferError("connection", f"TLS handshake with {host}:{port} failed: {error!r}") from error

    def _handshake(self, channel: FrameSocket) -> bytes:
        client_nonce = auth.new_nonce()
        channel.send(self.read_timeout_s, FrameType.HELLO, client_nonce)
        challenge = expect(channel.read_frame(self.read_timeout_s), FrameType.CHALLENGE).payload
        if len(challenge) != NONCE_BYTES + PROOF_BYTES:
            raise KVTransferError(
                "auth",
                f"expected CHALLENGE ({NONCE_BYTES}-byte nonce and {PROOF_BYTES}-byte "
                f"proof), got CHALLENGE ({len(challenge)} bytes)",
            )
        server_nonce, proof = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
        auth.verify(auth.server_proof(self.key, client_nonce, server_nonce), proof, "server")
        # The AUTH frame is not answered; the request that follows it is, which saves a round trip.
        channel.send(self.read_timeout_s, FrameType.AUTH, auth.client_proof(self.key, client_nonce, server_nonce))
        return auth.session_key(self.key, client_nonce, server_nonce)


def _close_unused(future: Future[tuple[FrameSocket, bytes]]) -> None:
    """A connect whose caller was cancelled: close what it opened."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()
