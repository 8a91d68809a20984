"""vllm-router (pip `vllm-router`, the Rust router of vLLM's production stack) as a real process on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.serving.ports import free_port

VLLM_ROUTER = Path(sys.executable).with_name("vllm-router")


@dataclass
class VllmRouter:
    """`vllm-router --vllm-pd-disaggregation --prefill URL... --decode URL...` on 127.0.0.1.

    In that mode vllm-router presents `Authorization: Bearer $OPENAI_API_KEY` (its own environment, like vLLM's
    disaggregated proxy) on every call to prefill and decode, never the client's key: `server_token` goes there.
    """

    prefill: Sequence[str]
    decode: Sequence[str]
    server_token: str
    log_path: Path
    port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)  # its exporter binds 29000 unless told otherwise
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> VllmRouter:
        command = [
            str(VLLM_ROUTER),
            "--vllm-pd-disaggregation",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.prometheus_port),
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
            "--worker-startup-timeout-secs",
            "60",
        ]
        for url in self.prefill:
            command += ["--prefill", url]
        for url in self.decode:
            command += ["--decode", url]
        env = {**os.environ, "OPENAI_API_KEY": self.server_token}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        return self.wait(timeout)

    def wait(self, timeout: float) -> VllmRouter:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"vllm-router not healthy within {timeout}s:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
