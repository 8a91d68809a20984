"""TLS on every pdserve listener and client (#17), with real processes on loopback and certificates made here.

One fleet serves every test: a scheduler, a colocated model server registered with it, and a gateway routing to
the server, each listener requiring a client certificate from the test CA (tls_client_auth required), each client
presenting one. The gateway's routing table and a completion through it prove gateway -> scheduler and
gateway -> server over mutual TLS; the scheduler's registry proves server -> scheduler. The agent, which has no
listener, is checked against a stand-in for vLLM's API server (a real TLS socket; a real vLLM costs minutes here).
"""

from __future__ import annotations

import datetime
import http.client
import http.server
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.gateway.settings import GatewaySettings
from pdserve.listener import TLS_SHUTDOWN_TIMEOUT_S
from tests.support.cluster import KEYS, write_keys_file
from tests.support.ports import free_port
from tests.support.serverproc import api_token_file
from tests.support.services import (
    Service,
    gateway_token_file,
    identity_key_file,
    instance_token_file,
    principal_token,
    write_secret,
)

RELOAD_SECONDS = "0.1"
START_TIMEOUT_S = 180.0
SERVER_ENGINE_ID = "tls0123456789abcdef0123456789ab"
LISTENERS = ("gateway", "scheduler", "server")


# --- certificates ------------------------------------------------------------------------------------------------


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass
class Pair:
    cert: bytes
    key: bytes
    serial: int


class CA:
    def __init__(self, name: str) -> None:
        self.key = _key()
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.name)
            .issuer_name(self.name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, *, client: bool = False) -> Pair:
        key, now, serial = _key(), datetime.datetime.now(datetime.UTC), x509.random_serial_number()
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return Pair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key), serial)


@dataclass
class Files:
    """Where one component's certificate and key live (rewritten in place to rotate)."""

    cert: Path
    key: Path

    def write(self, pair: Pair) -> Files:
        self.cert.write_bytes(pair.cert)
        self.key.write_bytes(pair.key)
        self.key.chmod(0o600)
        return self

    def serial(self) -> int:
        return x509.load_pem_x509_certificate(self.cert.read_bytes()).serial_number


@dataclass
class PKI:
    folder: Path
    ca: CA = field(default_factory=lambda: CA("pdserve-test-ca"))
    rogue: CA = field(default_factory=lambda: CA("some-other-ca"))

    @property
    def ca_file(self) -> Path:
        path = self.folder / "ca.pem"
        if not path.exists():
            path.write_bytes(self.ca.pem)
        return path

    def files(self, name: str, *, client: bool = False, ca: CA | None = None) -> Files:
        return Files(self.folder / f"{name}.pem", self.folder / f"{name}.key").write(
            (ca or self.ca).issue(name, client=client)
        )

    def context(self, client: Files | None = None, *, trust: bool = True) -> ssl.SSLContext:
        """A caller's context: trusting the test CA (or only the system's), presenting `client` if given."""
        context = ssl.create_default_context(cafile=str(self.ca_file) if trust else None)
        if client is not None:
            context.load_cert_chain(client.cert, client.key)
        return context


def tls_flags(pki: PKI, server: Files, client: Files) -> list[str]:
    return [
        "--tls-cert",
        str(server.cert),
        "--tls-key",
        str(server.key),
        "--tls-ca",
        str(pki.ca_file),
        "--tls-client-auth",
        "required",
        "--tls-client-cert",
        str(client.cert),
        "--tls-client-key",
        str(client.key),
        "--tls-reload-seconds",
        RELOAD_SECONDS,
    ]


# --- processes ---------------------------------------------------------------------------------------------------


@dataclass
class Listener:
    name: str
    service: Service
    files: Files
    ready_path: str

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.service.port}"


def wait_https(listener: Listener, context: ssl.SSLContext, timeout: float = START_TIMEOUT_S) -> None:
    listener.service.wait_http(
        listener.url + listener.ready_path, what=listener.name, timeout=timeout, verify=context, request_timeout=2
    )


@dataclass
class Fleet:
    tmp: Path
    pki: PKI
    caller: Files
    """the client certificate the test presents"""
    listeners: dict[str, Listener]

    def caller_context(self) -> ssl.SSLContext:
        return self.pki.context(self.caller)

    def get(self, name: str, path: str, **options: Any) -> httpx.Response:
        return httpx.get(self.listeners[name].url + path, verify=self.caller_context(), timeout=10, **options)


def _scheduler(tmp: Path, pki: PKI) -> Listener:
    files = pki.files("scheduler")
    args = [
        "--state-file",
        str(tmp / "state.json"),
        "--admin-token-file",
        str(tmp / "admin.token"),
        "--identity-key-file",
        str(identity_key_file(tmp)),
        "--heartbeat-interval",
        "0.5",
        *tls_flags(pki, files, pki.files("scheduler-client", client=True)),
    ]
    write_secret(tmp / "admin.token")
    return Listener("scheduler", Service("pdserve.scheduler", args, tmp / "scheduler.log"), files, "/health/live")


def _server(tmp: Path, pki: PKI, checkpoint: Path, scheduler: Listener) -> Listener:
    files = pki.files("server")
    instance = f"colocated-{SERVER_ENGINE_ID[:24]}"
    args = [
        "--model",
        str(checkpoint),
        "--api-token-file",
        str(api_token_file()),
        "--engine-id",
        SERVER_ENGINE_ID,
        "--scheduler-url",
        scheduler.url,
        "--scheduler-token-file",
        str(instance_token_file(tmp, instance)),
        "--heartbeat-seconds",
        "0.3",
        *tls_flags(pki, files, pki.files("server-client", client=True)),
    ]
    service = Service(
        "pdserve.cli", args, tmp / "server.log", role=["colocated"], program=[sys.executable, "-m", "pdserve.cli"]
    )
    return Listener("server", service, files, "/health/ready")


def _gateway(tmp: Path, pki: PKI, scheduler: Listener) -> Listener:
    files = pki.files("gateway")
    args = [
        "--scheduler-url",
        scheduler.url,
        "--scheduler-token-file",
        str(gateway_token_file(tmp)),
        "--server-token-file",
        str(api_token_file()),
        "--api-keys-file",
        str(write_keys_file(tmp / "keys.json")),
        "--routing-poll-interval",
        "0.2",
        "--offload-threshold-tokens",
        "0",
        *tls_flags(pki, files, pki.files("gateway-client", client=True)),
    ]
    return Listener("gateway", Service("pdserve.gateway", args, tmp / "gateway.log"), files, "/health/live")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, dense_checkpoint: Path) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("tls-fleet")
    pki = PKI(tmp)
    caller = pki.files("test-caller", client=True)
    scheduler = _scheduler(tmp, pki)
    listeners = {"scheduler": scheduler}
    try:
        scheduler.service.launch()
        wait_https(scheduler, pki.context(caller))
        listeners["server"] = _server(tmp, pki, dense_checkpoint, scheduler)
        listeners["gateway"] = _gateway(tmp, pki, scheduler)
        for name in ("server", "gateway"):
            listeners[name].service.launch()
        for name in ("server", "gateway"):
            wait_https(listeners[name], pki.context(caller))
        yield Fleet(tmp, pki, caller, listeners)
    finally:
        for listener in listeners.values():
            listener.service.stop()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# --- what a caller sees ------------------------------------------------------------------------------------------


def probe(port: int, context: ssl.SSLContext, path: str = "/health/live") -> tuple[int, int]:
    """One request on a new connection: (status, the serial of the certificate the listener presented)."""
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        assert connection.sock is not None
        der = connection.sock.getpeercert(binary_form=True)
        assert der is not None
        return response.status, x509.load_der_x509_certificate(der).serial_number
    finally:
        connection.close()


def plaintext_answer(port: int) -> bytes:
    """What a listener sends back to a plain HTTP request."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return received


# --- the listeners -----------------------------------------------------------------------------------------------


def test_the_fleet_talks_over_mutual_tls(fleet: Fleet):
    """gateway -> scheduler (its routing table), server -> scheduler (registered as https), gateway -> server."""
    auth = {"Authorization": f"Bearer {principal_token(fleet.tmp, 'gateway')}"}
    listed = fleet.get("scheduler", "/v1/instances", headers=auth).json()["instances"]
    server = [entry for entry in listed if entry["instance_id"] == f"colocated-{SERVER_ENGINE_ID[:24]}"]
    assert [entry["info"]["url"] for entry in server] == [f"https://127.0.0.1:{fleet.listeners['server'].service.port}"]
    wait_for(lambda: fleet.get("gateway", "/health/ready").status_code == 200, "the gateway routing to the server")
    response = httpx.post(
        fleet.listeners["gateway"].url + "/v1/completions",
        json={"model": server[0]["info"]["model"], "prompt": "hello there", "max_tokens": 4, "temperature": 0},
        headers={"Authorization": f"Bearer {KEYS['bulk']}"},
        verify=fleet.caller_context(),
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("name", LISTENERS)
def test_https_with_the_ca_works_and_a_client_without_it_refuses_the_server(fleet: Fleet, name: str):
    listener = fleet.listeners[name]
    status, serial = probe(listener.service.port, fleet.caller_context())
    assert (status, serial) == (200, listener.files.serial())
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(listener.url + "/health/live", verify=fleet.pki.context(fleet.caller, trust=False), timeout=10)


@pytest.mark.parametrize("name", LISTENERS)
def test_plaintext_to_a_tls_listener_fails(fleet: Fleet, name: str):
    answer = plaintext_answer(fleet.listeners[name].service.port)
    assert not answer.startswith(b"HTTP/"), answer[:200]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{fleet.listeners[name].service.port}/health/live", timeout=10)


@pytest.mark.parametrize("name", LISTENERS)
def test_required_client_auth_refuses_clients_without_a_certificate_from_the_ca(fleet: Fleet, name: str):
    listener = fleet.listeners[name]
    strangers = {
        "no certificate": fleet.pki.context(),
        "another CA's certificate": fleet.pki.context(
            fleet.pki.files(f"rogue-{name}", client=True, ca=fleet.pki.rogue)
        ),
    }
    for what, context in strangers.items():
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            probe(listener.service.port, context)
            pytest.fail(f"{name} answered a client with {what}")


@dataclass
class Load:
    """Requests on new connections from a few threads until stopped: each outcome (status, serial) or the error."""

    port: int
    context: ssl.SSLContext
    outcomes: list[tuple[int, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, threads: int = 3) -> list[threading.Thread]:
        workers = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
        for worker in workers:
            worker.start()
        return workers

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                outcome = probe(self.port, self.context)
            except Exception as error:  # every failure counts, whatever its kind
                with self.lock:
                    self.errors.append(repr(error))
                continue
            with self.lock:
                self.outcomes.append(outcome)

    def done(self) -> int:
        with self.lock:
            return len(self.outcomes) + len(self.errors)

    def wait(self, count: int, timeout: float = 120.0) -> None:
        wait_for(lambda: self.done() >= count, f"{count} requests")


@pytest.mark.parametrize("name", LISTENERS)
def test_a_rotated_certificate_is_served_without_a_failed_request(fleet: Fleet, name: str):
    """The pair is rewritten in place one file at a time (certificate, then key, with checks in between), under
    a load of new connections, while a keep-alive connection opened before stays in use."""
    listener = fleet.listeners[name]
    old, new = listener.files.serial(), fleet.pki.ca.issue(name)
    kept = http.client.HTTPSConnection("127.0.0.1", listener.service.port, context=fleet.caller_context(), timeout=30)
    kept.request("GET", "/health/live")
    assert kept.getresponse().read() and kept.sock is not None
    load = Load(listener.service.port, fleet.caller_context())
    workers = load.run()
    try:
        load.wait(50)
        listener.files.cert.write_bytes(new.cert)  # the half-written pair: new certificate, old key
        wait_for(lambda: "cannot be loaded yet" in listener.service.logs(), "the reloader to meet the half pair")
        load.wait(load.done() + 50)
        listener.files.key.write_bytes(new.key)
        wait_for(lambda: any(serial == new.serial for _, serial in load.outcomes[-10:]), "the new certificate served")
        load.wait(max(200, load.done() + 50))
    finally:
        load.stop.set()
        for worker in workers:
            worker.join(30)
    assert load.errors == []
    assert all(status == 200 for status, _ in load.outcomes)
    serials = [serial for _, serial in load.outcomes]
    assert serials[0] == old and serials[-1] == new.serial and set(serials) == {old, new.serial}
    assert serials.index(new.serial) >= 100  # still the old one while only the certificate had been rewritten
    kept.request("GET", "/health/live")
    assert kept.getresponse().status == 200  # the connection made before the swap went on working


def test_sighup_reloads_at_once(tmp_path: Path):
    """With a poll interval far beyond the test, SIGHUP alone makes the listener serve the new certificate."""
    pki = PKI(tmp_path)
    caller = pki.files("caller", client=True)
    listener = _scheduler(tmp_path, pki)
    listener.service.args = [*listener.service.args, "--tls-reload-seconds", "3600"]
    listener.service.launch()
    try:
        wait_https(listener, pki.context(caller))
        new = pki.ca.issue("scheduler")
        Files(listener.files.cert, listener.files.key).write(new)
        assert probe(listener.service.port, pki.context(caller))[1] != new.serial
        assert listener.service.process is not None
        listener.service.process.send_signal(signal.SIGHUP)
        wait_for(lambda: probe(listener.service.port, pki.context(caller))[1] == new.serial, "the reload on SIGHUP")
        assert listener.service.process.poll() is None
    finally:
        listener.service.stop()


def test_a_stalled_handshake_is_dropped_at_the_header_deadline(tmp_path: Path):
    """A client that connects and sends nothing, or half a ClientHello, is cut off at the header deadline (0.5 s
    here), long before asyncio's own 60 s handshake limit, which the 30 s wait below would not reach."""
    pki = PKI(tmp_path)
    caller = pki.files("caller", client=True)
    listener = _scheduler(tmp_path, pki)
    listener.service.env = {"PDSERVE_HTTP_HEADER_TIMEOUT_SECONDS": "0.5"}
    listener.service.launch()
    try:
        wait_https(listener, pki.context(caller))
        for sent in (b"", b"\x16\x03\x01\x02\x00\x01"):
            with socket.create_connection(("127.0.0.1", listener.service.port), timeout=30) as sock:
                sock.sendall(sent)
                try:
                    assert sock.recv(1024) == b"", f"after {sent!r}: the listener answered"
                except ConnectionResetError:
                    pass
                except TimeoutError:
                    pytest.fail(f"after {sent!r}: the listener kept the stalled handshake open")
        assert probe(listener.service.port, pki.context(caller))[0] == 200
    finally:
        listener.service.stop()


def test_sigterm_with_an_idle_keep_alive_caller_stops_the_listener_within_its_tls_shutdown_timeout(tmp_path: Path):
    """A caller's pooled connection, idle after one request, never answers the listener's close_notify: the stop
    waits TLS_SHUTDOWN_TIMEOUT_S for it, not asyncio's 30 s (past podman's stop grace), which the wait below would
    not reach, and shuts down cleanly."""
    pki = PKI(tmp_path)
    caller = pki.files("caller", client=True)
    listener = _scheduler(tmp_path, pki)
    listener.service.launch()
    try:
        wait_https(listener, pki.context(caller))
        kept = http.client.HTTPSConnection("127.0.0.1", listener.service.port, context=pki.context(caller))
        kept.request("GET", "/health/live")
        assert kept.getresponse().read() and kept.sock is not None  # open, idle, unread until the listener is gone
        assert listener.service.process is not None
        listener.service.process.send_signal(signal.SIGTERM)
        listener.service.process.wait(timeout=TLS_SHUTDOWN_TIMEOUT_S + 15)
        assert "Finished server process" in listener.service.logs()  # a clean shutdown, then SIGTERM re-raised
        kept.close()
    finally:
        listener.service.stop()


@pytest.mark.parametrize("component", ["scheduler", "server"])
def test_bad_tls_files_stop_the_start_naming_the_setting(tmp_path: Path, dense_checkpoint: Path, component: str):
    """A key that is not its certificate's: the listener's pair (scheduler), the client pair (a server, checked
    before its model loads)."""
    pki = PKI(tmp_path)
    other, server, client = pki.files("other"), pki.files("server"), pki.files("client", client=True)
    if component == "scheduler":
        flags = _scheduler(tmp_path, pki).service.args
        flags[flags.index("--tls-key") + 1] = str(other.key)
        command, named = [sys.executable, "-m", "pdserve.scheduler", "--port", str(free_port()), *flags], "tls_key"
    else:
        command = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "colocated",
            "--model",
            str(dense_checkpoint),
            "--port",
            str(free_port()),
            *tls_flags(pki, server, Files(client.cert, other.key)),
        ]
        named = "tls_client_key"
    finished = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert finished.returncode != 0
    assert named in finished.stderr and "not a matching PEM certificate and key" in finished.stderr, finished.stderr


def test_a_gateway_on_a_network_address_needs_tls_or_allow_plaintext():
    required = {
        "scheduler_url": "http://127.0.0.1:1",
        "scheduler_token_file": "t",
        "server_token_file": "t",
        "api_keys_file": "k",
        "metrics_token_file": "m",
    }
    anywhere = "0.0.0.0"
    with pytest.raises(ValueError, match=r"tls_cert: the gateway serves clients on 0\.0\.0\.0"):
        GatewaySettings.model_validate({**required, "host": anywhere})
    assert GatewaySettings.model_validate({**required, "host": anywhere, "allow_plaintext": True}).scheme == "http"
    assert GatewaySettings.model_validate({**required, "host": "127.0.0.1"}).scheme == "http"
    with pytest.raises(ValueError, match="tls_client_auth: required needs tls_ca"):
        GatewaySettings.model_validate({**required, "tls_cert": "c", "tls_key": "k", "tls_client_auth": "required"})
    with pytest.raises(ValueError, match="tls_cert and tls_key: give both or neither"):
        GatewaySettings.model_validate({**required, "tls_cert": "c"})


# --- the agent (a client only) -----------------------------------------------------------------------------------


class _Engine(http.server.ThreadingHTTPServer):
    """What the agent reads of vLLM's API server, over TLS requiring a client certificate; it records the serial
    of the client certificate of every connection, and every handshake that failed."""

    daemon_threads = True

    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), _EngineHandler)
        self.context = context
        self.client_serials: list[int] = []
        self.failed_handshakes: list[str] = []

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = self.socket.accept()
        try:
            wrapped = self.context.wrap_socket(sock, server_side=True)
        except (ssl.SSLError, OSError) as error:
            self.failed_handshakes.append(repr(error))
            sock.close()
            raise
        der = wrapped.getpeercert(binary_form=True)
        if der is not None:
            self.client_serials.append(x509.load_der_x509_certificate(der).serial_number)
        return wrapped, address


class _EngineHandler(http.server.BaseHTTPRequestHandler):
    BODIES = {
        "/health": ("text/plain", ""),
        "/v1/models": ("application/json", json.dumps({"data": [{"id": "tiny", "max_model_len": 256}]})),
        "/metrics": (
            "text/plain",
            "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n",
        ),
    }

    def do_GET(self) -> None:
        kind, body = self.BODIES.get(self.path, ("text/plain", "not found"))
        self.send_response(200 if self.path in self.BODIES else 404)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_the_agent_calls_vllm_and_the_scheduler_over_mutual_tls_and_picks_up_a_rotated_client_certificate(
    fleet: Fleet,
):
    pki, scheduler = fleet.pki, fleet.listeners["scheduler"]
    engine_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    engine_files = pki.files("engine")
    engine_context.load_cert_chain(engine_files.cert, engine_files.key)
    engine_context.load_verify_locations(pki.ca_file)
    engine_context.verify_mode = ssl.CERT_REQUIRED
    engine = _Engine(engine_context)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    port = engine.server_address[1]
    run_dir = fleet.tmp / "connector"
    run_dir.mkdir()
    (run_dir / "instance.json").write_text(
        json.dumps({"role": "kv_producer", "fingerprint": "sha256:tls", "kv_host": "127.0.0.1", "kv_port": free_port()})
    )
    client = pki.files("agent-client", client=True)
    instance = f"prefill-127.0.0.1-{port}"
    command = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "agent",
        "--engine-url",
        f"https://127.0.0.1:{port}",
        "--role",
        "prefill",
        "--scheduler-url",
        scheduler.url,
        "--scheduler-token-file",
        str(instance_token_file(fleet.tmp, instance)),
        "--advertise-url",
        f"https://127.0.0.1:{port}",
        "--version",
        "v1",
        "--connector-run-dir",
        str(run_dir),
        "--heartbeat-seconds",
        "0.2",
        "--drain-grace-seconds",
        "0",
        "--tls-ca",
        str(pki.ca_file),
        "--tls-client-cert",
        str(client.cert),
        "--tls-client-key",
        str(client.key),
        "--tls-reload-seconds",
        RELOAD_SECONDS,
    ]
    log_path = fleet.tmp / "agent.log"
    with log_path.open("wb") as log:
        agent = subprocess.Popen(command, stdout=log, stderr=log, env=os.environ.copy())
    auth = {"Authorization": f"Bearer {principal_token(fleet.tmp, 'gateway')}"}

    def state() -> str | None:
        listed = fleet.get("scheduler", "/v1/instances", headers=auth).json()["instances"]
        return next((entry["state"] for entry in listed if entry["instance_id"] == instance), None)

    try:
        wait_for(lambda: state() == "ready", "the agent's instance ready in the scheduler")
        old, new = client.serial(), pki.ca.issue("agent-client", client=True)
        seen = len(engine.client_serials)
        client.cert.write_bytes(new.cert)  # the half-written pair first, as in the listeners' rotation
        wait_for(lambda: "cannot be loaded yet" in log_path.read_text(), "the agent's reloader to meet the half pair")
        wait_for(lambda: len(engine.client_serials) >= seen + 5, "calls to vLLM while half written")
        client.key.write_bytes(new.key)
        wait_for(lambda: new.serial in engine.client_serials, "the rotated client certificate presented to vLLM")
        turned = engine.client_serials.index(new.serial)
        wait_for(lambda: len(engine.client_serials) >= turned + 5, "more calls to vLLM")
        assert state() == "ready"
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
        engine.shutdown()
    serials = engine.client_serials
    assert serials[0] == old and set(serials[turned:]) == {new.serial} and turned > seen + 4
    assert engine.failed_handshakes == []
    log = log_path.read_text()
    assert "heartbeat failed" not in log and "unreachable" not in log and "unreadable" not in log, log
    assert "TLS certificate reloaded" in log
