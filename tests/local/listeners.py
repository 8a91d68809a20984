"""Every TCP listener of the local environment's nodes, as `ss -ltn` in each node's network namespace lists it, and
what it does with a plaintext HTTP request and with a TLS handshake, with and without a client certificate (run inside
the namespace, so listeners bound to loopback are reached too)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Run in the node's namespace: a plaintext HTTP request, then TLS verified against the CA (by address: the
# certificates carry it) presenting the client pair, then TLS 1.2 presenting none. TLS 1.2 because there a server that
# wants a client certificate refuses the handshake itself; under TLS 1.3 it can only drop the connection afterwards.
# Prints {"plain": <first bytes answered, or "">, "tls": ..., "anonymous_tls": ...}, each "ok" or the error.
PROBE = r"""
import json, socket, ssl, sys
host, port, ca, cert, key = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
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
def attempt(pair, version):
    context = ssl.create_default_context(cafile=ca)
    context.maximum_version = version
    if pair:
        context.load_cert_chain(*pair)
    try:
        with socket.create_connection((host, port), timeout=5) as raw, context.wrap_socket(raw, server_hostname=host):
            return "ok"
    except (OSError, ssl.SSLError) as error:
        return f"{type(error).__name__}: {error}"
tls, anonymous = attempt((cert, key), ssl.TLSVersion.MAXIMUM_SUPPORTED), attempt(None, ssl.TLSVersion.TLSv1_2)
print(json.dumps({"plain": plain.decode("latin-1"), "tls": tls, "anonymous_tls": anonymous}))
"""


@dataclass(frozen=True)
class Probed:
    namespace: str
    address: str
    port: int
    plain: str  # what a plaintext HTTP request got back ("" = nothing: the connection was closed)
    tls: str  # "ok" when a TLS handshake verified against the CA, presenting the client certificate, completed
    anonymous_tls: str  # likewise for a TLS 1.2 handshake presenting none

    @property
    def answers_plaintext_http(self) -> bool:
        return self.plain.startswith("HTTP/")

    @property
    def refuses_plaintext_http(self) -> bool:
        """No HTTP answer, or only a 400 (Go's answer to plain HTTP on a TLS listener): nothing served."""
        status = self.plain.split("\r\n", 1)[0].split()
        return not self.answers_plaintext_http or status[1:2] == ["400"]

    @property
    def refuses_anonymous_tls(self) -> bool:
        """The server refused the handshake of a client without a certificate."""
        return self.anonymous_tls != "ok"

    @property
    def answers_plaintext(self) -> bool:
        """Bytes back that are not a TLS alert record (0x15): a plaintext protocol spoke."""
        return bool(self.plain) and not self.plain.startswith("\x15")


def listening(namespace: str, node_address: str) -> list[tuple[str, int]]:
    """(address, port) of every IPv4 TCP listener in the namespace; one on every address as the node's own (the
    address its certificate carries)."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-ltnH", "-4"], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for line in out.splitlines():
        address, port = line.split()[3].rsplit(":", 1)
        found.append((node_address if address == "0.0.0.0" else address, int(port)))
    return sorted(set(found))


def probe(namespace: str, address: str, port: int, ca: Path, client: tuple[Path, Path]) -> Probed:
    """`client`: the certificate and key the first TLS attempt presents."""
    argv = [sys.executable, "-c", PROBE, address, str(port), str(ca), *map(str, client)]
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, *argv], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    result = json.loads(out)
    return Probed(namespace, address, port, result["plain"], result["tls"], result["anonymous_tls"])
