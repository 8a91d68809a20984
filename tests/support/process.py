"""One lifecycle for the server processes tests start as children: the output to a log file, ready once an HTTP GET
answers 200 (failing at once if the process exits first), stopped with SIGTERM and then SIGKILL, or killed outright
as a crash would.

The harnesses built on it differ only in what they run and where they answer: Daemon here (any argv that answers
HTTP: Prometheus, Alertmanager, node_exporter), tests.support.services.Service (`python -m MODULE --host --port`, or
a router's binary), tests.support.serverproc.ServerProcess (a pdserve model server with the test API token) and
tests/vllm's AgentProcess. tests/vllm's VLLMServer keeps a lifecycle of its own (see there).
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

STOP_GRACE_S = 10.0


class ChildProcess:
    """The lifecycle. A harness (a dataclass, usually) has a `process` and a `log_path` (None: the output is dropped)
    and calls spawn() with its command line."""

    process: subprocess.Popen[bytes] | None
    log_path: Path | None

    def spawn(self, command: Sequence[str], env: Mapping[str, str] | None = None, *, append: bool = False) -> None:
        """Start `command` (this environment plus `env`), stdout and stderr to log_path, appended to when `append`
        (a process restarted on the same log) or written anew."""
        environment = {**os.environ, **(env or {})}
        if self.log_path is None:
            self.process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=environment
            )
            return
        with self.log_path.open("ab" if append else "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)

    def wait_http(
        self,
        url: str,
        *,
        what: str,
        timeout: float,
        interval: float = 0.1,
        verify: ssl.SSLContext | bool = True,
        request_timeout: float = 1.0,
    ) -> None:
        """Until GET `url` answers 200. A process that exits first fails at once; one that does not answer within
        `timeout` is stopped, and fails. Both failures carry the end of the log."""
        assert self.process is not None, f"{what} was never started"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.process.returncode}:\n{self.log_tail(50)}")
            try:
                if httpx.get(url, timeout=request_timeout, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(interval)
        self.stop()
        raise RuntimeError(f"{what} did not answer {url} within {timeout} s:\n{self.log_tail(50)}")

    def kill(self) -> None:
        """SIGKILL: the process dies without any cleanup, as a crashed server would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM, and SIGKILL if it has not exited after `grace` seconds."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Daemon(ChildProcess):
    """A program on loopback that says it is ready over HTTP (Prometheus' and Alertmanager's /-/ready, or another
    `ready_path`); `verify` is how to call an HTTPS url (the CA, and a client certificate if it requires one)."""

    name: str
    argv: list[str]
    url: str
    log_path: Path | None
    process: subprocess.Popen[bytes] | None = None
    verify: ssl.SSLContext | None = None
    ready_path: str = "/-/ready"

    def start(self, timeout: float = 30.0) -> Daemon:
        self.spawn(self.argv)
        self.wait_http(self.url + self.ready_path, what=self.name, timeout=timeout, verify=self.verify or True)
        return self
