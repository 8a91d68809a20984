"""The KV channel's listener: started from the prefill server's event loop, each connection served on its own thread.

A thread per connection (blocking sockets, pdserve.kv.wire) lets the streams of a pull run on different cores; the
event loop that starts the server is not on the data path at all. This module accepts, authenticates and dispatches;
a pull stream is served by pdserve.kv.sender, which waits on its connection thread for a streamed blob (prefill
still adding to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import select
import socket
import ssl
import threading
import time

from pdserve.common.kv_tls import SocketWrapper
from pdserve.kv import auth
from pdserve.kv.admission import DropLog, DropReason, KVListenerSettings, Slots, source_of
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.protocol import (
    MAX_HANDSHAKE_PAYLOAD,
    MAX_REQUEST_PAYLOAD,
    NONCE_BYTES,
    PROOF_BYTES,
    Frame,
    FrameType,
    error_body,
    expect,
    json_payload,
)
from pdserve.kv.sender import NOTSENT_LOWAT_BYTES, PullSender
from pdserve.kv.store import LeaseStore
from pdserve.kv.wire import FrameSocket

log = logging.getLogger(__name__)
READ_BUFFER_BYTES = 64 << 10  # most a connection buffers in user space before authenticating (it reads frame by frame)
LISTEN_BACKLOG = 1024
ERROR_LINGER_S = 1.0  # how long a refused client has to read its ERROR before the connection closes
JOIN_S = 5.0  # how long close() waits for the connection threads after aborting their sockets


class _Link:
    """One accepted connection: its socket (replaced by the TLS socket once wrapped), abortable from any thread, and
    the source its slot counts against (pdserve.kv.admission)."""

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock
        self.source = source
        self.evicted = False  # its slot went to a newer connection: it ends without a word

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def evict(self) -> None:
        self.evicted = True
        self.abort()


class KVServer:
    """Serves pulls and acks for the blobs in a LeaseStore over authenticated (optionally TLS) TCP connections."""

    def __init__(
        self,
        store: LeaseStore,
        key: auth.SecretKey,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: SocketWrapper | None = None,
        io_timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        limits: KVListenerSettings | None = None,
        metrics: KVMetrics | None = None,
        tcp_congestion: str | None = None,
        open_wait_s: float = 0.0,
        keepalive_s: float = 1.0,
        notsent_lowat_bytes: int = NOTSENT_LOWAT_BYTES,
    ) -> None:
        """`limits` (default KVListenerSettings()) bound what connections hold before and after authenticating
        (pdserve.kv.admission): the whole handshake (TLS, then HELLO to AUTH) ends within its
        kv_handshake_timeout_seconds, unauthenticated connections hold capped slots the oldest of which a new one
        takes, authenticated ones are capped too.

        A pull of an id not held yet waits up to `open_wait_s` for prefill to open it (early dispatch: decode may
        ask first), then fails `not_found`; while a pull waits it gets a KEEPALIVE every `keepalive_s`.

        The streams of a pull share its chunks (pdserve.kv.share); each stream of a pull of several queues at most
        `notsent_lowat_bytes` unsent in the kernel (TCP_NOTSENT_LOWAT) before a send waits."""
        self.store = store
        self._key = key
        self._host = host
        self._port = port
        self._ssl = ssl_context
        self._io_timeout = io_timeout_s
        self._idle_timeout = idle_timeout_s
        self._limits = limits if limits is not None else KVListenerSettings()
        self._handshake_timeout = self._limits.kv_handshake_timeout_seconds
        self._slots = Slots(self._limits)
        self._metrics = metrics if metrics is not None else default_metrics()
        self._drops = DropLog(self._metrics, self._limits.kv_drop_log_seconds)
        self._tcp_congestion = tcp_congestion
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._connections: dict[threading.Thread, _Link] = {}
        self._closing = False
        self._sender = PullSender(
            store, self._metrics, io_timeout_s, idle_timeout_s, open_wait_s, keepalive_s, notsent_lowat_bytes
        )

    @property
    def shared_pulls(self) -> int:
        """Multi-stream pulls whose shared chunk plan the server still holds (a stream of theirs has not ended)."""
        return self._sender.shared_pulls

    @property
    def connections(self) -> tuple[int, int]:
        """Connections holding a slot: (not yet authenticated, authenticated)."""
        return self._slots.pending, self._slots.authenticated

    @property
    def drop_log_lines(self) -> int:
        """Lines logged about dropped connections so far (at most one per kv_drop_log_seconds)."""
        return self._drops.lines

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("KVServer is not started")
        return int(self._listener.getsockname()[1])

    async def start(self) -> None:
        family, _type, _proto, _name, address = socket.getaddrinfo(
            self._host or None, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._tcp_congestion is not None:
                _set_congestion_control(listener, self._tcp_congestion)
            listener.bind(address)
            listener.listen(LISTEN_BACKLOG)
        except BaseException:
            listener.close()
            raise
        self._listener, self._closing = listener, False
        self._acceptor = threading.Thread(
            target=self._accept_forever, args=(listener,), name="pdstack-kv-accept", daemon=True
        )
        self._acceptor.start()

    async def close(self) -> None:
        listener, acceptor = self._listener, self._acceptor
        if listener is None or acceptor is None:
            return
        self._closing = True
        # Aborting the sockets (rather than closing them under the threads) lets each thread end on its own error path.
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        await asyncio.to_thread(acceptor.join, JOIN_S)
        listener.close()
        with self._lock:
            links = dict(self._connections)
        for link in links.values():
            link.abort()
        deadline = time.monotonic() + JOIN_S
        for thread in links:
            await asyncio.to_thread(thread.join, max(0.0, deadline - time.monotonic()))
        self._listener = self._acceptor = None

    def _accept_forever(self, listener: socket.socket) -> None:
        while not self._closing:
            try:
                sock, peer = listener.accept()
            except OSError as error:
                if self._closing:
                    return
                log.warning("kv: accept failed: %s", error)
                time.sleep(0.05)  # out of descriptors, say: do not spin
                continue
            link = _Link(sock, source_of(peer))
            thread = threading.Thread(
                target=self._on_connection, args=(link, peer), name="pdstack-kv-conn", daemon=True
            )
            with self._lock:
                if self._closing:
                    sock.close()
                    return
                self._connections[thread] = link
            for victim in self._slots.admit(link, link.source):
                victim.evict()
                self._drops.note("evicted", link.source, "a newer unauthenticated connection took its slot")
            thread.start()

    def _on_connection(self, link: _Link, peer: object) -> None:
        try:
            self._serve_connection(link, peer)
        except Exception:  # a bug must not end the thread silently
            log.exception("kv: connection from %s failed", peer)
        finally:
            self._slots.leave(link, link.source)
            with self._lock:
                self._connections.pop(threading.current_thread(), None)
            with contextlib.suppress(OSError):
                link.sock.close()

    def _serve_connection(self, link: _Link, peer: object) -> None:
        authenticated = self._handshake_or_drop(link)
        if authenticated is not None:
            self._serve_requests(*authenticated, peer)

    def _handshake_or_drop(self, link: _Link) -> tuple[FrameSocket, bytes] | None:
        """The authenticated connection and its session key, or None once a failed handshake was counted, logged
        (at a bounded rate) and answered; an evicted connection ends without a word (its eviction was counted)."""
        deadline = time.monotonic() + self._handshake_timeout
        try:
            return self._bounded_handshake(link, deadline)
        except KVTransferError as error:
            if not link.evicted:
                self._metrics.observe_auth_refused()
                self._drops.note(self._refusal_reason(error, deadline), link.source, error.message)
                self._send_error(FrameSocket(link.sock), error)  # the slot stays held while the client reads it
        except (ssl.SSLError, OSError) as error:
            if not link.evicted:
                self._drops.note("deadline" if time.monotonic() >= deadline else "tls", link.source, str(error))
        return None

    def _serve_requests(self, channel: FrameSocket, session: bytes, peer: object) -> None:
        # One authenticated connection serves any number of requests, one after another, until the client closes
        # it, it idles out, or a request fails (the connection is then in no known state, so it is closed).
        for served in itertools.count():
            try:
                frame = channel.read_frame(self._idle_timeout, MAX_REQUEST_PAYLOAD)
            except KVTransferError as error:
                if error.cause in ("connection", "timeout"):
                    return  # the client closed or went idle between requests
                self._metrics.observe_failure("sender", error.cause)
                log.info("kv: bad request frame from %s: %s", peer, error)
                self._send_error(channel, error)
                return
            self._metrics.observe_connection("sender", "reused" if served else "new")
            try:
                self._dispatch(frame, channel, session)
            except KVTransferError as error:
                self._metrics.observe_failure("sender", error.cause)
                log.info("kv: request from %s failed: %s", peer, error)
                self._send_error(channel, error)
                return

    @staticmethod
    def _refusal_reason(error: KVTransferError, deadline: float) -> DropReason:
        if error.cause == "capacity":
            return "capacity"
        return "deadline" if time.monotonic() >= deadline else "handshake"

    def _bounded_handshake(self, link: _Link, deadline: float) -> tuple[FrameSocket, bytes]:
        """Authenticate the client (after TLS, if any) by `deadline`, then move it to an authenticated slot; return
        the connection and the session key END frames are MACed under."""
        if self._ssl is not None:
            self._tls_handshake(link, deadline)
        channel, session = self._authenticate(FrameSocket(link.sock), deadline)
        self._slots.authenticate(link, link.source)
        return channel, session

    def _tls_handshake(self, link: _Link, deadline: float) -> None:
        """TLS is part of the handshake: under the same slot, by the same deadline (CPython's do_handshake bounds all
        of its reads together by the socket's timeout, not each one by it). The TLS socket replaces the plain one
        (which wrapping detaches) before the handshake starts, so an eviction can abort it."""
        assert self._ssl is not None
        tls = self._ssl.wrap_socket(link.sock, server_side=True, do_handshake_on_connect=False)
        link.sock = tls
        if link.evicted:  # evicted while the plain socket was being detached: that abort reached nothing
            raise KVTransferError("connection", "evicted before it authenticated")
        tls.settimeout(max(0.001, deadline - time.monotonic()))
        tls.do_handshake()

    def _authenticate(self, channel: FrameSocket, deadline: float) -> tuple[FrameSocket, bytes]:
        hello = self._handshake_frame(channel, deadline, FrameType.HELLO, NONCE_BYTES, "nonce")
        if not self._slots.has_room_to_authenticate():  # said before CHALLENGE, so decode's connect retries it
            raise KVTransferError("capacity", self._slots.full_message())
        server_nonce = auth.new_nonce()
        channel.send(
            self._io_timeout,
            FrameType.CHALLENGE,
            server_nonce + auth.server_proof(self._key, hello.payload, server_nonce),
        )
        proof = self._handshake_frame(channel, deadline, FrameType.AUTH, PROOF_BYTES, "proof")
        auth.verify(auth.client_proof(self._key, hello.payload, server_nonce), proof.payload, "client")
        return channel, auth.session_key(self._key, hello.payload, server_nonce)

    def _handshake_frame(self, channel: FrameSocket, deadline: float, wanted: FrameType, size: int, what: str) -> Frame:
        """One handshake frame by the handshake deadline, read only if its header claims at most
        MAX_HANDSHAKE_PAYLOAD bytes."""
        expected = f"{wanted.name} ({size}-byte {what})"
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise KVTransferError("timeout", "handshake deadline passed")
            frame = channel.read_frame(min(self._io_timeout, remaining), MAX_HANDSHAKE_PAYLOAD)
        except KVTransferError as error:
            if error.cause == "timeout" and remaining <= self._io_timeout:
                raise KVTransferError(
                    "auth", f"expected HELLO then AUTH within {self._handshake_timeout:g} s, the handshake took longer"
                ) from None
            raise KVTransferError("auth", f"expected {expected}, got no valid frame: {error.message}") from None
        if frame.type is not wanted or len(frame.payload) != size:
            raise KVTransferError("auth", f"expected {expected}, got {frame.type.name} ({len(frame.payload)} bytes)")
        return frame

    def _dispatch(self, frame: Frame, channel: FrameSocket, session: bytes) -> None:
        if frame.type is FrameType.PULL:
            self._sender.serve(frame, channel, session)
        elif frame.type is FrameType.ACK:
            request_id = str(expect(frame, FrameType.ACK).json().get("request_id", ""))
            released = self.store.ack(request_id)
            channel.send(
                self._io_timeout, FrameType.ACK_OK, json_payload({"request_id": request_id, "released": released})
            )
        else:
            raise KVTransferError("protocol", f"unexpected {frame.type.name} frame")

    def _send_error(self, channel: FrameSocket, error: KVTransferError) -> None:
        """Send ERROR, then let the client read it: the connection is about to close, and closing with the client's
        bytes unread (a refused frame's payload, a request behind it) resets it, which can discard the ERROR before
        the client reads it."""
        with contextlib.suppress(Exception):
            channel.send(1.0, FrameType.ERROR, error_body(error.cause, error.message))
            _drain_before_close(channel.sock)


def _drain_before_close(sock: socket.socket) -> None:
    """Shut our side and read (and drop) what the client still sends until it closes too, at most
    READ_BUFFER_BYTES within ERROR_LINGER_S: a close with unread bytes would send a reset instead of a FIN."""
    socket.socket.shutdown(sock, socket.SHUT_WR)  # the plain socket's, also under TLS
    deadline, drained = time.monotonic() + ERROR_LINGER_S, 0
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    while drained < READ_BUFFER_BYTES and (remaining := deadline - time.monotonic()) > 0:
        if not poller.poll(remaining * 1000):
            return
        data = socket.socket.recv(sock, READ_BUFFER_BYTES, socket.MSG_DONTWAIT)
        if not data:
            return
        drained += len(data)


def _set_congestion_control(listener: socket.socket, name: str) -> None:
    """Pick the sender's TCP congestion control; accepted connections inherit it from the listener (Linux)."""
    try:
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as error:
        raise ValueError(f"tcp_congestion: the kernel refuses {name!r} ({error.strerror})") from error
