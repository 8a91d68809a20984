"""Hostile loopback clients for the KV listener's flood tests, and what a server process holds while they run.

A Flood keeps `sockets` TCP connections open to a KV port from one loopback source address, each saying nothing or
only the first bytes of a TLS ClientHello, and replaces each one the server drops as soon as it notices (issue #33's
attack). It is bounded: loopback only, at most `max_connects` connects, and it runs until stopped.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HOSTILE_SOURCE = "127.0.0.2"  # loopback, but not the key holder's 127.0.0.1: a source of its own
CLIENT_HELLO_START = bytes([0x16, 0x03, 0x01])  # a TLS handshake record's first bytes; the rest never comes
CONNECT_TIMEOUT_S = 2.0
MAX_CONNECTS = 40_000  # ~1/2 of the ephemeral ports of one source address


@dataclass
class Flood:
    port: int
    sockets: int
    opening: bytes = b""
    source: str = HOSTILE_SOURCE
    max_connects: int = MAX_CONNECTS
    connects: int = 0  # connections opened so far
    dropped: int = 0  # connections the server closed (each then replaced)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Flood:
        self._thread = threading.Thread(target=self._run, name="hostile-flood", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def wait_until_open(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.connects < self.sockets and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.connects >= self.sockets, f"opened {self.connects} of {self.sockets} hostile sockets"

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            try:
                for _ in range(self.sockets):
                    self._open(selector)
                while not self._stop.is_set():
                    for key, _events in selector.select(0.05):
                        self._replace(selector, key.fileobj)  # type: ignore[arg-type]
            finally:
                for key in list(selector.get_map().values()):
                    key.fileobj.close()  # type: ignore[union-attr]

    def _open(self, selector: selectors.BaseSelector) -> None:
        if self.connects >= self.max_connects or self._stop.is_set():
            return
        self.connects += 1
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), CONNECT_TIMEOUT_S, (self.source, 0))
            sock.sendall(self.opening)
        except OSError:
            return  # the backlog full, say: the next drop opens another
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)

    def _replace(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        """Readable: the server closed it (or sent an ERROR before closing): drop ours, open a new one."""
        with contextlib.suppress(OSError):
            if sock.recv(4096):
                return  # an ERROR frame or a TLS alert; its close follows
        selector.unregister(sock)
        sock.close()
        self.dropped += 1
        self._open(selector)


@dataclass(frozen=True)
class Holding:
    """What a process holds: open descriptors, threads, resident memory, and CPU time used so far."""

    fds: int
    threads: int
    rss_bytes: int
    cpu_seconds: float

    @classmethod
    def of(cls, pid: int) -> Holding:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return cls(
            fds=len(os.listdir(f"/proc/{pid}/fd")),
            threads=int(status["Threads"]),
            rss_bytes=int(status["VmRSS"].split()[0]) * 1024,
            cpu_seconds=(int(stat[11]) + int(stat[12])) / ticks,  # utime + stime
        )

    def __str__(self) -> str:
        return f"{self.fds} fds, {self.threads} threads, RSS {self.rss_bytes / (1 << 20):.1f} MiB"


def counter(metrics_port: int, name: str, labels: str = "") -> float:
    """A counter's value from a Prometheus endpoint on loopback (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    wanted = f"{name}_total{{{labels}}}" if labels else f"{name}_total"
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0
