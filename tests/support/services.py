"""Start control-plane services as real processes on loopback ports, and wait for them to answer (the lifecycle is
tests.support.process's)."""

from __future__ import annotations

import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.scheduler.identity import GATEWAY, derive_token, instance_principal
from tests.support.ports import free_port
from tests.support.process import ChildProcess


@dataclass
class Service(ChildProcess):
    """A `python -m MODULE` process listening on 127.0.0.1:port; its stderr (JSON logs) goes to `log_path`."""

    module: str
    args: list[str]
    log_path: Path
    role: list[str] = field(default_factory=list)
    """arguments before the flags, e.g. ["decode"] for `python -m pdserve.cli decode ...`"""
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    program: list[str] = field(default_factory=list)
    """the command to run instead of `python -m MODULE` (e.g. a router's binary)"""
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/health/live", timeout: float = 60.0) -> Service:
        return self.launch().wait(ready_path, timeout)

    def launch(self) -> Service:
        """Start it; its log is appended to, so a service restarted on the same log keeps the earlier lines."""
        program = self.program or [sys.executable, "-m", self.module]
        self.spawn(
            [*program, *self.role, "--host", "127.0.0.1", "--port", str(self.port), *self.args], self.env, append=True
        )
        return self

    def wait(self, ready_path: str = "/health/live", timeout: float = 60.0) -> Service:
        self.wait_http(self.url + ready_path, what=self.module, timeout=timeout, interval=0.05)
        return self

    def logs(self) -> str:
        return self.log_path.read_text()


def write_secret(path: Path) -> str:
    token = secrets.token_urlsafe(24)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def identity_key_file(tmp: Path) -> Path:
    """The identity key of the scheduler started in `tmp` (created on first use, so tokens can be derived first)."""
    path = tmp / "identity.key"
    if not path.exists():
        write_secret(path)
    return path


def principal_token(tmp: Path, principal: str) -> str:
    """The bearer token of `principal` under the identity key in `tmp`."""
    return derive_token(identity_key_file(tmp).read_text().strip(), principal)


def principal_token_file(tmp: Path, principal: str) -> Path:
    """A secret file holding `principal`'s token, as a node's --scheduler-token-file would."""
    path = tmp / "tokens" / (principal.replace(":", "_") + ".token")
    path.parent.mkdir(exist_ok=True)
    path.write_text(principal_token(tmp, principal) + "\n")
    path.chmod(0o600)
    return path


def instance_token_file(tmp: Path, instance_id: str) -> Path:
    """The token file of the server (or agent) registering as `instance_id`."""
    return principal_token_file(tmp, instance_principal(instance_id))


def gateway_token_file(tmp: Path) -> Path:
    """The token file a gateway reads the routing table with."""
    return principal_token_file(tmp, GATEWAY)


def start_scheduler(
    tmp: Path, heartbeat_interval: float = 0.2, missed: int = 3, port: int | None = None, state_file: Path | None = None
) -> tuple[Service, str]:
    """A scheduler process; returns it and its admin token (principal tokens: principal_token(tmp, ...))."""
    token_file = tmp / "admin.token"
    token = token_file.read_text().strip() if token_file.exists() else write_secret(token_file)
    args = [
        "--state-file",
        str(state_file or tmp / "scheduler-state.json"),
        "--admin-token-file",
        str(token_file),
        "--identity-key-file",
        str(identity_key_file(tmp)),
        "--heartbeat-interval",
        str(heartbeat_interval),
        "--missed-heartbeats",
        str(missed),
    ]
    service = Service("pdserve.scheduler", args, tmp / "scheduler.log")
    if port is not None:
        service.port = port
    return service.start(), token
