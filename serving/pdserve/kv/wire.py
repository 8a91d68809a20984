"""Blocking frame I/O on one socket, for the threads that serve and receive KV streams.

Each KV stream runs on its own thread with a blocking socket (plain or TLS), so streams run on separate cores: the
socket calls, the CRC-32C over a frame and the BLAKE3 digests release the GIL while they work on a payload. DATA
goes out with one sendmsg of (header, sub-header, the slice of the blob's array) and comes in with recv_into the
destination array: no copy in Python on either side.

Every read is bounded by a deadline (a frame must be complete within its timeout); every write by a timeout per
wait for the peer to read. `abort` (any thread) wakes a thread blocked on the socket; only the thread that owns the
socket closes it, so its descriptor is never reused under a call still running on it.
"""

from __future__ import annotations

import contextlib
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

SMALL_PARTS_BYTES = 256  # parts up to this size are joined to the header before a TLS send (one record, not three)


class FrameSocket:
    """Frames over one connected blocking socket (TCP_NODELAY, as asyncio sets it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.closed = False
        self.last_sent = time.monotonic()  # when the last frame went out (the server's KEEPALIVEs are timed from it)
        self._kernel_timeouts = False  # plain socket in blocking mode, bounded by SO_RCVTIMEO / SO_SNDTIMEO
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

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
        """Fill `view` (format 'B') from the socket by `deadline`."""
        filled, size = 0, len(view)
        with self._errors(timeout, "receive"):
            while filled < size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                self._bound(socket.SO_RCVTIMEO, remaining)
                try:
                    count = self.sock.recv_into(view[filled:], size - filled, 0 if self.tls else socket.MSG_WAITALL)
                except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
                    continue
                if not count:
                    raise KVTransferError(
                        "connection", f"connection closed with {size - filled} bytes of a frame still to come"
                    )
                filled += count

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
