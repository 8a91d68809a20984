"""Blocking frame I/O on one socket, for the threads that serve and receive KV streams.

Each KV stream runs on its own thread with a blocking socket (plain or TLS), so streams run on separate cores: the
socket calls, the CRC-32C over a frame and the BLAKE3 digests release the GIL while they work on a payload. DATA
goes out with one sendmsg of (header, sub-header, the slice of the blob's array) and comes in with recv_into the
destination array: no copy in Python on either side.

A read times out when no byte of the frame came for `timeout`, and only if nothing is waiting in the socket by then
(a thread that was itself kept off the CPU past the deadline reads what arrived meanwhile). A server's reads count
from when the frame's read began (what it reads before and between requests stays bounded however a client trickles
bytes). A client's (`probe_peer`) count from its last bytes; the kernel sends TCP keepalive probes every
PROBE_INTERVAL_S while the peer is quiet, and a read silent for `timeout` goes on waiting while the peer's TCP stack
still answers them, up to `stall_timeout_s` of silence: a server process kept off the CPU (a busy forward on its
core, a nice'd thread, an oversubscribed host) is alive though it sends nothing, whereas a host or link that is gone
stops answering and fails the read within `timeout`. Every write is bounded by a timeout per wait for the peer to
read.

`abort` (any thread) wakes a thread blocked on the socket; only the thread that owns the
socket closes it, so its descriptor is never reused under a call still running on it.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import struct
import time
from collections.abc import Iterator

from pdserve.kv.errors import KVTransferError
from pdserve.kv.protocol import (
    HEADER,
    MAX_CONTROL_PAYLOAD,
    Frame,
    FrameType,
    Header,
    check_header,
    encode_header,
)

log = logging.getLogger(__name__)
SMALL_PARTS_BYTES = 256  # parts up to this size are joined to the header before a TLS send (one record, not three)
PROBE_INTERVAL_S = 1  # TCP keepalive probes of a quiet peer (whole seconds: TCP_KEEPIDLE / TCP_KEEPINTVL)
PROBE_COUNT = 10  # unanswered probes after which the kernel itself ends the connection
TCP_INFO_BYTES = 104
TCPI_LAST_ACK_RECV = 56  # offset of tcpi_last_ack_recv (ms since the peer's last ACK) in struct tcp_info (Linux)


class FrameSocket:
    """Frames over one connected blocking socket (TCP_NODELAY, as asyncio sets it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.closed = False
        self.last_sent = time.monotonic()  # when the last frame went out (the server's KEEPALIVEs are timed from it)
        self.stall_timeout_s = 0.0  # > 0: reads wait this long for a peer whose TCP still answers (see the module)
        self._last_bytes = 0.0  # when the last bytes came in
        self._reported_quiet = 0.0  # the start of the last silence logged as a stalled server
        self._kernel_timeouts = False  # plain socket in blocking mode, bounded by SO_RCVTIMEO / SO_SNDTIMEO
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def probe_peer(self, stall_timeout_s: float) -> None:
        """Let reads outwait a peer that is alive but sends nothing, up to `stall_timeout_s` (TCP keepalive probes
        tell the two apart)."""
        self.stall_timeout_s = stall_timeout_s
        with contextlib.suppress(OSError, AttributeError):  # not TCP, or not Linux: reads keep `timeout` alone
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, PROBE_INTERVAL_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, PROBE_INTERVAL_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, PROBE_COUNT)

    def _bound(self, option: int, seconds: float) -> None:
        """The next call waits at most `seconds`. A plain socket stays blocking and the kernel enforces the bound
        (SO_RCVTIMEO / SO_SNDTIMEO): a recv with MSG_WAITALL or a sendmsg of a whole frame is then one system call
        that sleeps in the kernel until done, instead of a poll and a partial call per piece (each of which takes the
        GIL back). TLS sockets use Python's own timeouts."""
        if self.tls:
            self.sock.settimeout(seconds)
            return
        if not self._kernel_timeouts:
            self.sock.settimeout(None)
            self._kernel_timeouts = True
        micros = max(1, int(seconds * 1e6))  # 0 would mean no bound at all
        self.sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", micros // 1_000_000, micros % 1_000_000))

    # writing

    def send(self, timeout: float, frame_type: FrameType, *parts: bytes | memoryview) -> None:
        """Send one frame whose payload is `parts` (not joined); the peer must take each piece within `timeout`."""
        header = encode_header(frame_type, *parts)
        with self._errors(timeout, "send"):
            self._bound(socket.SO_SNDTIMEO, timeout)
            if self.tls:
                self._send_tls(header, parts)
            else:
                self._sendmsg([memoryview(header), *(memoryview(part) for part in parts)])
        self.last_sent = time.monotonic()

    def _sendmsg(self, views: list[memoryview]) -> None:
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except BlockingIOError as error:  # SO_SNDTIMEO passed with nothing sent
                raise TimeoutError from error
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def _send_tls(self, header: bytes, parts: tuple[bytes | memoryview, ...]) -> None:
        head, rest = bytearray(header), list(parts)
        while rest and len(rest[0]) <= SMALL_PARTS_BYTES:
            head += rest.pop(0)
        self.sock.sendall(head)
        for part in rest:
            self.sock.sendall(part)

    # reading

    def read_header(self, timeout: float, max_payload: int) -> tuple[Header, float]:
        """The next frame's header, checked, and the deadline its payload must arrive by."""
        deadline = time.monotonic() + timeout
        raw = self.recv_bytes(HEADER.size, deadline, timeout)
        magic, version, raw_type, _flags, length, crc = HEADER.unpack(raw)
        check_header(magic, version, raw_type, length, max_payload)
        return Header(FrameType(raw_type), length, crc, raw), deadline

    def read_frame(self, timeout: float, max_payload: int = MAX_CONTROL_PAYLOAD) -> Frame:
        """One whole frame within `timeout`, its CRC verified."""
        header, deadline = self.read_header(timeout, max_payload)
        payload = self.recv_bytes(header.length, deadline, timeout)
        header.check_crc(payload)
        return Frame(header.type, payload)

    def read_reply(self, timeout: float, max_payload: int = MAX_CONTROL_PAYLOAD) -> Frame:
        """The next frame that is not a KEEPALIVE (each KEEPALIVE restarts the `timeout`)."""
        while True:
            frame = self.read_frame(timeout, max_payload)
            if frame.type is not FrameType.KEEPALIVE:
                return frame

    def recv_bytes(self, size: int, deadline: float, timeout: float) -> bytes:
        buffer = bytearray(size)
        self.recv_into(memoryview(buffer), deadline, timeout)
        return bytes(buffer)

    def recv_into(self, view: memoryview, deadline: float, timeout: float) -> None:
        """Fill `view` (format 'B') from the socket; `deadline` is when the frame's read began plus `timeout`."""
        filled, size = 0, len(view)
        with self._errors(timeout, "receive"):
            while filled < size:
                wait = self._wait_for_bytes(deadline, timeout)
                self._bound(socket.SO_RCVTIMEO, wait)
                try:
                    count = self.sock.recv_into(view[filled:], size - filled, 0 if self.tls else socket.MSG_WAITALL)
                except (BlockingIOError, TimeoutError):  # the bound passed with nothing received (plain, TLS)
                    continue
                if not count:
                    raise KVTransferError(
                        "connection", f"connection closed with {size - filled} bytes of a frame still to come"
                    )
                filled += count
                self._last_bytes = time.monotonic()

    def _wait_for_bytes(self, deadline: float, timeout: float) -> float:
        """How long the next receive may wait for a frame read by `deadline`; raise TimeoutError when the peer has
        been silent too long. A server's reads keep the whole frame's deadline (what it reads before and between
        requests stays bounded however a client trickles bytes); a client's count from the last bytes."""
        now = time.monotonic()
        quiet = deadline - timeout
        if self.stall_timeout_s > 0:
            quiet = max(quiet, self._last_bytes)
        if now < quiet + timeout:
            return quiet + timeout - now
        if self._bytes_waiting():
            return 0.001  # they came while this thread was off the CPU: not a silent peer
        if self.stall_timeout_s <= 0 or not self._peer_answers(timeout):
            raise TimeoutError
        if self._reported_quiet != quiet:  # once per silence: an operator sees a starved server, not a hang
            self._reported_quiet = quiet
            log.warning(
                "kv: the server sent nothing for %.1f s but its TCP answers; waiting up to stall_timeout_s (%g s)",
                now - quiet,
                self.stall_timeout_s,
            )
        if now >= quiet + self.stall_timeout_s:
            raise KVTransferError(
                "timeout",
                f"no complete frame within {self.stall_timeout_s:g} s (stall_timeout_s): the peer's TCP answered, "
                "its server sent nothing",
            )
        return min(float(PROBE_INTERVAL_S), quiet + self.stall_timeout_s - now)

    def _bytes_waiting(self) -> bool:
        try:
            return bool(self.tls and self.sock.pending()) or _poll_readable(self.sock)  # type: ignore[attr-defined]
        except OSError:
            return True  # the receive reports what happened

    def _peer_answers(self, timeout: float) -> bool:
        """Whether the peer's TCP stack acknowledged something (data or a keepalive probe) recently."""
        try:
            info = socket.socket.getsockopt(self.sock, socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        except (OSError, AttributeError):
            return False
        if len(info) < TCPI_LAST_ACK_RECV + 4:
            return False
        last_ack_ms = int(struct.unpack_from("I", info, TCPI_LAST_ACK_RECV)[0])
        return last_ack_ms / 1000 < max(timeout, 3 * PROBE_INTERVAL_S)

    def readable_now(self) -> bool:
        """Whether the peer sent something (or closed) without being asked: an idle connection must stay silent."""
        if self.closed:
            return True
        try:
            self.sock.settimeout(0)
            self._kernel_timeouts = False
            if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
                return True
            return _poll_readable(self.sock)
        except OSError:
            return True

    # ending

    def abort(self) -> None:
        """Wake whoever is blocked on this socket (any thread): both directions are shut down."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the plain socket's, also under TLS

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()

    @contextlib.contextmanager
    def _errors(self, timeout: float, what: str) -> Iterator[None]:
        try:
            yield
        except TimeoutError as error:
            if what == "send":
                raise KVTransferError("timeout", f"peer did not read for {timeout:g} s") from error
            raise KVTransferError("timeout", f"no complete frame within {timeout:g} s") from error
        except (ssl.SSLError, OSError) as error:
            raise KVTransferError("connection", f"connection lost while trying to {what} a frame: {error!r}") from error


def _poll_readable(sock: socket.socket) -> bool:
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))
