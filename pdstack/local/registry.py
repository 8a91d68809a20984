"""The local image registry: Debian's `docker-registry`, run by us on the host's service address.

Nodes pull the runtime images from it by digest, as cloud nodes pull from ECR. It runs without a daemon manager:
one background process, its pid and storage under the environment's state folder.

Given credentials (the local AWS's ECR token, pdstack.local.aws.LocalAws.registry_credentials), it refuses anonymous
pulls and pushes, as ECR does: htpasswd auth (bcrypt, made by apache2-utils' `htpasswd` from the password on its
standard input, never a command line) for the one user ECR's token names (`AWS`). A self-joining node logs in with
the token it gets from the local ECR API (pdstack.node.registry); the controller-driven nodes get the same
credential through roles/container_runtime (`registry_auth_vars`); pushes from the host read an auth file under the
state folder (0600).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from pdstack.local.commands import run_captured
from pdstack.local.topology import SERVICE_ADDRESS
from pdstack.node.registry import write_auth_file

PORT = 5000
CONFIG = """\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: {address}:{port}
"""
AUTH = """\
auth:
  htpasswd:
    realm: pdstack-local
    path: {htpasswd}
"""
# Where podman on a controller-driven node finds the credentials without REGISTRY_AUTH_FILE set (Ansible's podman
# modules run no login shell, so the role's profile.d export does not reach them): root's own auth file, which
# podman reads by default (${XDG_CONFIG_HOME:-$HOME/.config}/containers/auth.json).
NODE_AUTH_FILE = "/root/.config/containers/auth.json"


class RegistryError(RuntimeError):
    """The registry did not start (a failed push raises CommandError, naming the image and the target)."""


class Registry:
    def __init__(
        self,
        state_dir: Path,
        address: str = str(SERVICE_ADDRESS),
        port: int = PORT,
        credentials: tuple[str, str] | None = None,
    ) -> None:
        """`credentials` (user, password): the only login it accepts; None: anonymous access (the tests' registries)."""
        self.state_dir = state_dir
        self.address = address
        self.port = port
        self._credentials = credentials

    def credentials(self) -> tuple[str, str] | None:
        """(user, password) it requires, or None when it admits anyone."""
        return self._credentials

    @property
    def auth_file(self) -> Path:
        """podman's auth file (`--authfile`) holding its credential, written by start() (0600)."""
        return self.state_dir / "registry-auth.json"

    @property
    def _htpasswd(self) -> Path:
        return self.state_dir / "registry.htpasswd"

    @property
    def endpoint(self) -> str:
        """`host:port` as image references name it."""
        return f"{self.address}:{self.port}"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "registry.pid"

    def pid(self) -> int | None:
        if not self._pid_file.is_file():
            return None
        pid = int(self._pid_file.read_text())
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def healthy(self) -> bool:
        """It answers the API's base (401 asking for a login counts: it is up, and refusing anonymous callers)."""
        try:
            return httpx.get(f"http://{self.endpoint}/v2/", timeout=2).status_code in (200, 401)
        except httpx.HTTPError:
            return False

    def _config(self, root: Path) -> str:
        text = CONFIG.format(root=root, address=self.address, port=self.port)
        return text + AUTH.format(htpasswd=self._htpasswd) if self._credentials else text

    def _write_logins(self) -> bool:
        """The htpasswd file and the host's auth file for the credentials; True when the htpasswd file changed (a
        running registry reads it at start only)."""
        if self._credentials is None:
            return False
        user, password = self._credentials
        if shutil.which("htpasswd") is None:
            raise RegistryError("the registry's login needs `htpasswd` (apache2-utils: scripts/host-setup.sh)")
        write_auth_file(self.auth_file, {self.endpoint: base64.b64encode(f"{user}:{password}".encode()).decode()})
        if self._htpasswd.is_file():
            verify = run_captured(["htpasswd", "-v", "-i", str(self._htpasswd), user], stdin=password, check=False)
            if verify.returncode == 0:
                return False
        line = run_captured(["htpasswd", "-n", "-i", "-B", user], stdin=password).stdout.strip()
        fd = os.open(self._htpasswd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(line + "\n")
        return True

    def start(self) -> None:
        """Start it, or restart it when its configuration or login changed (e.g. auth turned on); else nothing."""
        root = self.state_dir / "registry"
        root.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "registry.yml"
        wanted = self._config(root)
        changed = self._write_logins()
        changed = changed or not config.is_file() or config.read_text() != wanted
        if self.pid() is not None and self.healthy():
            if not changed:
                return
            self.stop()
        config.write_text(wanted)
        with (self.state_dir / "registry.log").open("a") as log:
            process = subprocess.Popen(
                ["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._pid_file.write_text(str(process.pid))
        deadline = time.monotonic() + 20
        while not self.healthy():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RegistryError(f"registry did not start; see {self.state_dir / 'registry.log'}")
            time.sleep(0.2)

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
        self._pid_file.unlink(missing_ok=True)

    def push(self, local_image: str, repository: str, tag: str) -> str:
        """Push a local image; return its reference by digest (`host:port/repo@sha256:...`)."""
        target = f"{self.endpoint}/{repository}:{tag}"
        digest_file = self.state_dir / f"{repository.replace('/', '_')}.digest"
        login = ["--authfile", str(self.auth_file)] if self._credentials else []
        run_captured(
            ["podman", "push", "--tls-verify=false", *login, "--digestfile", str(digest_file), local_image, target]
        )
        return f"{self.endpoint}/{repository}@{digest_file.read_text().strip()}"


def registry_auth_vars(registry: Registry) -> dict[str, Any]:
    """The controller-driven nodes' login to `registry` (roles/container_runtime: container_runtime_registry_auths),
    written where podman reads it by default; nothing when the registry admits anyone."""
    credentials = registry.credentials()
    if credentials is None:
        return {}
    user, password = credentials
    return {
        "container_runtime_registry_auths": [{"registry": registry.endpoint, "username": user, "password": password}],
        "container_runtime_auth_file": NODE_AUTH_FILE,
    }
