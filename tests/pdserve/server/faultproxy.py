"""A loopback TCP proxy that flips one byte of what the upstream (prefill's KV port) sends back."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field


@dataclass
class ByteFlipProxy:
    upstream_port: int
    flip_at: int  # offset in a connection's server-to-client bytes; the first connection to reach it is corrupted
    flipped: bool = False
    port: int = 0
    _listener: socket.socket = field(default_factory=socket.socket)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> ByteFlipProxy:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, downstream: bool) -> None:
        seen = 0
        try:
            while data := source.recv(65536):
                if downstream and seen <= self.flip_at < seen + len(data):
                    data = self._maybe_flip(bytearray(data), self.flip_at - seen)
                seen += len(data)
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _maybe_flip(self, data: bytearray, index: int) -> bytes:
        with self._lock:
            if not self.flipped:
                data[index] ^= 0x40
                self.flipped = True
        return bytes(data)
