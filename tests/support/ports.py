"""Ports for the servers tests start, taken below the kernel's ephemeral port range.

bind(0) hands out a port from the ephemeral range, the range the kernel also draws the source ports of outgoing
connections from: in the seconds between that check and the server's own bind on a loaded machine, an outgoing
connection can take the port and the server fails to start. Below that range only listeners take ports.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

FIRST = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_LIMIT = max(_ephemeral_low(), FIRST + 1000)
_SPAN = _LIMIT - FIRST
_OFFSET = (os.getpid() * 127) % _SPAN  # each test process probes from its own place, so parallel runs rarely meet
_TRIED = itertools.count()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether `port` on `host` can be bound now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now, outside the ephemeral range ("0.0.0.0": on every address, for
    a listener reached through the podman bridge)."""
    for _ in range(_SPAN):
        port = FIRST + (_OFFSET + next(_TRIED)) % _SPAN
        if port_is_free(port, host):
            return port
    raise RuntimeError(f"no free port between {FIRST} and {_LIMIT}")
