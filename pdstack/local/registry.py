"""The local image registry: Debian's `docker-registry`, run by us on the host's service address.

Nodes pull the runtime images from it by digest, as cloud nodes pull from ECR. It runs without a daemon manager:
one background process, its pid and storage under the environment's state folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from pdstack.local.commands import run_captured
from pdstack.local.topology import SERVICE_ADDRESS

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


class RegistryError(RuntimeError):
    """The registry did not start (a failed push raises CommandError, naming the image and the target)."""


class Registry:
    def __init__(self, state_dir: Path, address: str = str(SERVICE_ADDRESS), port: int = PORT) -> None:
        self.state_dir = state_dir
        self.address = address
        self.port = port

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
        try:
            return httpx.get(f"http://{self.endpoint}/v2/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> None:
        if self.pid() is not None and self.healthy():
            return
        root = self.state_dir / "registry"
        root.mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "registry.yml"
        config.write_text(CONFIG.format(root=root, address=self.address, port=self.port))
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
        run_captured(["podman", "push", "--tls-verify=false", "--digestfile", str(digest_file), local_image, target])
        return f"{self.endpoint}/{repository}@{digest_file.read_text().strip()}"
