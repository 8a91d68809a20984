"""Real Prometheus and Alertmanager (Debian's binaries) on loopback with the configurations the roles render, and a
webhook receiver standing in for the operator's pager: what the alert-delivery tests run against."""

from __future__ import annotations

import json
import secrets
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdstack.contract import ALERTMANAGER_API
from tests.support import REPO

ANSIBLE_PLAYBOOK = str(REPO / ".venv" / "bin" / "ansible-playbook")
CONTRACT_VARS = REPO / "playbooks" / "vars" / "contract" / "local.yml"
ALERTS = REPO / "monitoring" / "alerts.yml"
MAX_BODY = 1 << 20  # Alertmanager's payloads here are a few KiB
READY_TIMEOUT_S = 30.0

Payload = dict[str, Any]


class Webhook:
    """An HTTP receiver on loopback taking Alertmanager's webhook POSTs at /hook/<token> only (the token is the
    credential a webhook URL carries); anything else is refused before its body is read."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.token = secrets.token_urlsafe(16)
        self.payloads: list[Payload] = []
        self.refused = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/hook/{self.token}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 5  # seconds a client may take to send its request

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or -1)
                if self.path != f"/hook/{hook.token}" or not 0 <= length <= MAX_BODY:
                    with hook._lock:
                        hook.refused += 1
                    self.send_error(404 if self.path != f"/hook/{hook.token}" else 413)
                    return
                payload = json.loads(self.rfile.read(length))
                with hook._lock:
                    hook.payloads.append(payload)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def start(self) -> Webhook:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def received(self) -> list[Payload]:
        with self._lock:
            return list(self.payloads)

    def alerts(self, alertname: str, **labels: str) -> list[tuple[str, Payload]]:
        """(receiver, alert) of every delivered alert with that name and labels, in arrival order."""
        return [(p["receiver"], a) for p in self.received() for a in p["alerts"]
                if a["labels"].get("alertname") == alertname
                and all(a["labels"].get(k) == v for k, v in labels.items())]  # fmt: skip

    def wait_for(
        self, alertname: str, count: int = 1, timeout: float = 30.0, **labels: str
    ) -> list[tuple[str, Payload]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.alerts(alertname, **labels)
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise AssertionError(f"{count} x {alertname} {labels} not delivered within {timeout} s; got {self.received()}")


def render(tmp_path: Path, inventory: dict[str, Any], variables: dict[str, Any]) -> Path:
    """Render roles/prometheus's and roles/alertmanager's templates with Ansible (the contract's local variables,
    then `variables`) into tmp_path/prometheus.yml and tmp_path/alertmanager.yml."""
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    templates = {"prometheus": "prometheus.yml", "alertmanager": "alertmanager.yml"}
    tasks = [{"name": f"render {role}", "ansible.builtin.template": {
        "src": str(REPO / "roles" / role / "templates" / f"{name}.j2"), "dest": str(tmp_path / name), "mode": "0600"}}
        for role, name in templates.items()]  # fmt: skip
    (tmp_path / "render.yml").write_text(yaml.safe_dump([{
        "name": "render", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars_files": [str(REPO / "roles" / role / "defaults" / "main.yml") for role in templates],
        "tasks": tasks}]))  # fmt: skip
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(tmp_path / "inventory.yml"), str(tmp_path / "render.yml"),
         "-e", f"@{CONTRACT_VARS}", "-e", json.dumps(variables), "-e", "ansible_python_interpreter=/usr/bin/python3"],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path


def fast_rules(folder: Path) -> Path:
    """monitoring/alerts.yml with every `for:` removed: the same expressions, firing on their first true evaluation."""
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)
    folder.mkdir(exist_ok=True)
    (folder / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    return folder


def severity_of(alertname: str) -> str:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alertname:
                return str(rule["labels"]["severity"])
    raise KeyError(alertname)


@dataclass
class Daemon:
    name: str
    argv: list[str]
    url: str
    log: Path
    process: subprocess.Popen[bytes] | None = field(default=None)
    verify: ssl.SSLContext | None = None  # how to call an HTTPS url (the CA, and a client certificate if required)

    def start(self) -> Daemon:
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.process.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1, verify=self.verify or True).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {READY_TIMEOUT_S} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def post_alert(alertmanager: str, alertname: str, **labels: str) -> None:
    """An alert as Prometheus posts it (labels incl. the rule's severity, no end: Alertmanager keeps it firing)."""
    alert = {"labels": {"alertname": alertname, "severity": severity_of(alertname), **labels},
             "annotations": {"summary": f"{alertname} (test)"}}  # fmt: skip
    response = httpx.post(f"{alertmanager}{ALERTMANAGER_API}/alerts", json=[alert], timeout=5)
    assert response.status_code == 200, response.text


def create_silence(alertmanager: str, matchers: dict[str, str], minutes: int = 10) -> str:
    now = time.time()
    body = {
        "matchers": [{"name": k, "value": v, "isRegex": False, "isEqual": True} for k, v in matchers.items()],
        "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 1)),
        "endsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 60 * minutes)),
        "createdBy": "tests/alerting",
        "comment": "silenced by the test",
    }
    response = httpx.post(f"{alertmanager}{ALERTMANAGER_API}/silences", json=body, timeout=5)
    assert response.status_code == 200, response.text
    return str(response.json()["silenceID"])


def alert_state(alertmanager: str, alertname: str, **labels: str) -> dict[str, Any]:
    """Alertmanager's view of one alert: its status (state, silencedBy, inhibitedBy)."""
    matchers = [f'alertname="{alertname}"', *(f'{k}="{v}"' for k, v in labels.items())]
    filters = [("filter", m) for m in matchers]
    response = httpx.get(f"{alertmanager}{ALERTMANAGER_API}/alerts", params=filters, timeout=5)
    response.raise_for_status()
    found = response.json()
    assert len(found) == 1, found
    return dict(found[0]["status"])
