"""Every TCP listener of the local environment's nodes, as `ss -ltn` in each node's network namespace lists it, and
what it does with a plaintext HTTP request and with a TLS handshake (run inside the namespace, so listeners bound to
loopback are reached too)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Run in the node's namespace: a plaintext HTTP request, then a TLS handshake verified against the CA (by address:
# the certificates carry it). Prints {"plain": <first bytes answered, or "">, "tls": <"ok" or the error>}.
PROBE = r"""
import json, socket, ssl, sys
host, port, ca = sys.argv[1], int(sys.argv[2]), sys.argv[3]
plain = b""
try:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"GET /health/live HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        s.settimeout(5)
        while len(plain) < 64:
            chunk = s.recv(64)
            if not chunk:
                break
            plain += chunk
except OSError:
    pass
try:
    context = ssl.create_default_context(cafile=ca)
    with socket.create_connection((host, port), timeout=5) as raw, context.wrap_socket(raw, server_hostname=host):
        tls = "ok"
except (OSError, ssl.SSLError) as error:
    tls = f"{type(error).__name__}: {error}"
print(json.dumps({"plain": plain.decode("latin-1"), "tls": tls}))
"""


@dataclass(frozen=True)
class Probed:
    namespace: str
    address: str
    port: int
    plain: str  # what a plaintext HTTP request got back ("" = nothing: the connection was closed)
    tls: str  # "ok" when a TLS handshake verified against the CA completed

    @property
    def answers_plaintext_http(self) -> bool:
        return self.plain.startswith("HTTP/")

    @property
    def answers_plaintext(self) -> bool:
        """Bytes back that are not a TLS alert record (0x15): a plaintext protocol spoke."""
        return bool(self.plain) and not self.plain.startswith("\x15")


def listening(namespace: str, node_address: str) -> list[tuple[str, int]]:
    """(address, port) of every IPv4 TCP listener in the namespace; one on every address as the node's own (the
    address its certificate carries)."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "ss", "-ltnH", "-4"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    found = []
    for line in out.splitlines():
        address, port = line.split()[3].rsplit(":", 1)
        found.append((node_address if address == "0.0.0.0" else address, int(port)))
    return sorted(set(found))


def probe(namespace: str, address: str, port: int, ca: Path) -> Probed:
    out = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", PROBE, address, str(port), str(ca)],
                         capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
    result = json.loads(out)
    return Probed(namespace, address, port, result["plain"], result["tls"])
