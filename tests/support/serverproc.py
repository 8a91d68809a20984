"""Real pdserve model-server processes on loopback for the tests: start, wait until ready, stop (the lifecycle is
tests.support.process's)."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.gateway.proxy import prefill_body
from tests.support.ports import free_port
from tests.support.process import ChildProcess

READY_TIMEOUT_S = 180.0  # model loads crawl when the CI host is oversubscribed
# The model-server API token every test server of this process is started with (prefill and decode require one).
API_TOKEN = secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
_TOKEN_DIR = Path(tempfile.mkdtemp(prefix="pdserve-test-token-"))


def api_token_file() -> Path:
    """A file holding API_TOKEN (made once per test process), for --api-token-file and the gateway's
    --server-token-file."""
    path = _TOKEN_DIR / "server-api.token"
    if not path.exists():
        path.write_text(API_TOKEN)
        path.chmod(0o600)
    return path


@dataclass
class ServerProcess(ChildProcess):
    role: str
    model: Path
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Prefill and decode get --api-token-file API_TOKEN unless the args give one (colocated only if asked)."""
        token = (
            []
            if self.role == "colocated" or "--api-token-file" in self.args
            else ["--api-token-file", str(api_token_file())]
        )
        command = [
            sys.executable,
            "-m",
            "pdserve.cli",
            self.role,
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *token,
            *self.args,
        ]
        self.spawn(command, self.env)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        self.wait_http(f"{self.url}/health/ready", what=f"{self.role} server", timeout=timeout)
        return self

    def ready_info(self) -> dict[str, object]:
        """What the server logged once ready (role, model, fingerprint, kv_port, engine_id): its open /health/ready
        says only whether it is ready."""
        assert self.log_path is not None, "ready_info reads the server's log: give the server a log_path"
        ready = [record for record in _json_lines(self.log_path) if record.get("message") == "ready"]
        assert ready, f"the {self.role} server logged no ready line:\n{self.log_tail(20)}"
        return ready[-1]  # a restarted server appends to its log

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def post(self, path: str, body: object, **options: object) -> httpx.Response:
        """POST a JSON body with the API token."""
        return httpx.post(self.url + path, json=body, headers=AUTH, timeout=options.pop("timeout", 60), **options)  # type: ignore[arg-type]


def _json_lines(path: Path) -> list[dict[str, object]]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def start_all(servers: Sequence[ServerProcess]) -> list[ServerProcess]:
    """Start in parallel (model loads overlap), then wait for each."""
    for server in servers:
        server.start()
    try:
        for server in servers:
            server.wait_ready()
    except Exception:
        for server in servers:
            server.stop()
        raise
    return list(servers)


def metric_value(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """The value of one sample in Prometheus text format (0.0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        if metric != name:
            continue
        found = dict(item.split("=", 1) for item in label_text.rstrip("}").split(",") if item) if label_text else {}
        found = {k: v.strip('"') for k, v in found.items()}
        if all(found.get(k) == v for k, v in (labels or {}).items()):
            return float(value)
    return 0.0


def prefill(url: str, body: dict[str, object], endpoint: str = "/v1/completions") -> dict[str, object]:
    """What vLLM's proxy sends prefill (as the gateway does): max_tokens=1, no streaming, the six KV fields."""
    response = httpx.post(url + endpoint, json=prefill_body(body), timeout=60, headers=AUTH)
    response.raise_for_status()
    params = response.json()["kv_transfer_params"]
    assert params is not None, "prefill answered without kv_transfer_params"
    return dict(params)
