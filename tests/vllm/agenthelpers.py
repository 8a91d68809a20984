"""A pdstack control plane in front of a real vLLM pair: scheduler, gateways, and one `pdserve agent` per vLLM.

The agents run in vLLM's environment (this test process's Python), which proves they import there. The scheduler
and the gateways are control-plane processes with their own environment: pdserve's (`.venv`, or
$PDSTACK_MAIN_PYTHON), since vLLM's lacks the gateway's rate-limit dependencies.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.scheduler.client import bearer
from tests.support import REPO
from tests.support.cluster import KEYS, write_keys_file
from tests.support.ports import free_port
from tests.support.process import ChildProcess
from tests.support.services import (
    Service,
    gateway_token_file,
    instance_token_file,
    principal_token,
    start_scheduler,
    write_secret,
)
from tests.vllm.conftest import BLOCK_SIZE, LEASE_SECONDS, VLLMServer, prompt_of

MODEL_NAME = "tiny"
API_KEY = KEYS["bulk"]
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def main_python() -> str:
    """The interpreter of pdserve's own environment, where the gateway's dependencies are installed."""
    python = os.environ.get("PDSTACK_MAIN_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(
            f"the gateway needs pdserve's environment: {python} is missing (make venv, or set PDSTACK_MAIN_PYTHON)"
        )
    return python


@dataclass
class AgentProcess(ChildProcess):
    """One `python -m pdserve.cli agent` for one vLLM instance (tests.support.process's lifecycle; a stop gives it a
    minute to drain)."""

    role: str
    engine: VLLMServer
    run_dir: Path
    fleet: Fleet
    process: subprocess.Popen[bytes] | None = None

    @property
    def instance_id(self) -> str:
        return f"{self.role}-127.0.0.1-{self.engine.port}"

    @property
    def log_path(self) -> Path:
        return self.fleet.tmp / f"agent-{self.role}.log"

    def start(self, *extra: str) -> AgentProcess:
        args = [
            "--engine-url",
            self.engine.url,
            "--role",
            self.role,
            "--scheduler-url",
            self.fleet.scheduler.url,
            "--scheduler-token-file",
            str(instance_token_file(self.fleet.tmp, self.instance_id)),
            "--advertise-url",
            self.engine.url,
            "--version",
            "v1",
            "--connector-run-dir",
            str(self.run_dir),
            "--engine-token-file",
            str(self.fleet.engine_token_file),
            "--heartbeat-seconds",
            "0.5",
            "--drain-grace-seconds",
            "1",
            "--engine-timeout-seconds",
            "1",
            *extra,
        ]
        self.spawn([sys.executable, "-m", "pdserve.cli", "agent", *args], append=True)
        return self

    def stop(self, grace: float = 60.0) -> None:
        super().stop(grace)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class Fleet:
    tmp: Path
    scheduler: Service
    admin_token: str
    prefill: VLLMServer
    decode: VLLMServer
    engine_token_file: Path
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    gateways: list[Service] = field(default_factory=list)
    _gateway_logs: Iterator[int] = field(default_factory=itertools.count)
    unready_samples: list[tuple[str, str]] = field(default_factory=list)
    """(instance id, scheduler state) seen while that instance's vLLM /health was not yet 200"""

    def admin(self) -> dict[str, str]:
        return bearer(self.admin_token)

    def instances(self) -> dict[str, dict[str, Any]]:
        listed = httpx.get(f"{self.scheduler.url}/v1/instances", headers=self.admin(), timeout=5).json()["instances"]
        return {entry["instance_id"]: entry for entry in listed}

    def state(self, instance_id: str) -> str:
        entry = self.instances().get(instance_id)
        return "absent" if entry is None else str(entry["state"])

    def wait_state(self, instance_id: str, states: set[str], timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.state(instance_id)) not in states:
            assert time.monotonic() < deadline, f"{instance_id} stayed {state}, expected {states}"
            time.sleep(0.2)
        return state

    @contextlib.contextmanager
    def routed_gateway(self, *flags: str) -> Iterator[Service]:
        """A gateway routing to both instances, stopped at the end (a module's own: the fleet outlives it)."""
        gateway = self.start_gateway(*flags)
        try:
            self.wait_routable(gateway)
            yield gateway
        finally:
            gateway.stop()
            self.gateways.remove(gateway)

    def start_gateway(self, *flags: str) -> Service:
        keys = write_keys_file(self.tmp / "api-keys.json")
        args = [
            "--scheduler-url",
            self.scheduler.url,
            "--api-keys-file",
            str(keys),
            "--scheduler-token-file",
            str(gateway_token_file(self.tmp)),
            "--server-token-file",
            str(self.engine_token_file),
            "--routing-poll-interval",
            "0.2",
            "--offload-threshold-tokens",
            "0",
            *flags,
        ]
        gateway = Service(
            "pdserve.gateway",
            args,
            self.tmp / f"gateway-{next(self._gateway_logs)}.log",
            program=[main_python(), "-m", "pdserve.gateway"],
        ).start(timeout=120)
        self.gateways.append(gateway)
        return gateway

    def wait_routable(self, gateway: Service, instances: int = 2, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{gateway.url}/health/ready", timeout=5).json()["instances"] != instances:
            assert time.monotonic() < deadline, f"gateway never routed to {instances} instances"
            time.sleep(0.2)

    def colocated(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The prefill instance's own greedy answer to the whole request (the connector takes no part)."""
        body = {
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        response = httpx.post(self.prefill.url + "/v1/completions", json=body, timeout=120, headers=self.engine_auth())
        assert response.status_code == 200, response.text
        return list(response.json()["choices"][0]["token_ids"])

    def colocated_chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        body = {
            "model": MODEL_NAME,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(
            self.prefill.url + "/v1/chat/completions", json=body, timeout=120, headers=self.engine_auth()
        )
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    def engine_auth(self) -> dict[str, str]:
        return bearer(self.engine_token_file.read_text().strip())

    def loads(self) -> int:
        """KV loads decode completed so far, by its connector's log."""
        return self.decode.log().count("pdstack connector: loaded the KV of")

    def register_fake(self, instance_id: str, role: str, url: str, fingerprint: str) -> None:
        """An instance registered and reported ready through the scheduler's own API (with its own token)."""
        auth = bearer(principal_token(self.tmp, f"instance:{instance_id}"))
        info = {
            "instance_id": instance_id,
            "role": role,
            "version": "v1",
            "kv_fingerprint": fingerprint,
            "url": url,
            "model": MODEL_NAME,
            "kv_host": "127.0.0.1",
            "kv_port": free_port(),
        }
        assert httpx.post(f"{self.scheduler.url}/v1/instances", json=info, headers=auth).status_code == 201
        self.beat_fake(instance_id)

    def beat_fake(self, instance_id: str) -> None:
        """A ready, idle heartbeat for a fake instance (the scheduler declares silent ones dead after 10 s)."""
        auth = bearer(principal_token(self.tmp, f"instance:{instance_id}"))
        beat = {"load": {"ready": True, "max_concurrency": 128}}
        assert (
            httpx.post(
                f"{self.scheduler.url}/v1/instances/{instance_id}/heartbeat", json=beat, headers=auth
            ).status_code
            == 200
        )

    def remove_fake(self, instance_id: str) -> None:
        auth = bearer(principal_token(self.tmp, f"instance:{instance_id}"))
        httpx.delete(f"{self.scheduler.url}/v1/instances/{instance_id}", headers=auth)


def _healthy(server: VLLMServer) -> bool:
    try:
        return httpx.get(server.url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready_sampling(fleet: Fleet) -> None:
    """Wait for both vLLM instances, sampling what the scheduler says of each agent's instance meanwhile: a state
    read before a /health that is still not 200 was read while vLLM was not up (it only comes up once)."""
    pending = {"prefill": fleet.prefill, "decode": fleet.decode}
    deadline = time.monotonic() + 420
    while pending:
        for role, server in list(pending.items()):
            if server.process is not None and server.process.poll() is not None:
                pytest.fail(f"vLLM {role} exited:\n{server.log_tail()}")
            state = fleet.state(fleet.agents[role].instance_id)
            if _healthy(server):
                del pending[role]
            else:
                fleet.unready_samples.append((fleet.agents[role].instance_id, state))
        assert time.monotonic() < deadline, "vLLM not ready in 420 s"
        time.sleep(1)


def start_fleet(model_dir: Path, kv_key_file: Path, tmp: Path) -> Iterator[Fleet]:
    """Scheduler, vLLM prefill (core 0) and decode (core 1) with PdstackConnector, an agent for each, started
    together; the fixture yields once both agents' instances are ready in the scheduler."""
    scheduler, admin_token = start_scheduler(tmp, heartbeat_interval=0.5, missed=20)
    engine_token_file = tmp / "vllm-api.key"
    write_secret(engine_token_file)
    common = {
        "kv_key_file": str(kv_key_file),
        "advertise_host": "127.0.0.1",
        "kv_lease_seconds": LEASE_SECONDS,
        "kv_connect_timeout_seconds": 3,
        "kv_read_timeout_seconds": 5,
    }
    # One argument: a token may start with "-" (token_urlsafe), which argparse would take for an option.
    args = ("--served-model-name", MODEL_NAME, f"--api-key={engine_token_file.read_text().strip()}")
    run_dirs = {role: tmp / f"run-{role}" for role in ROLES}
    prefill = VLLMServer(
        "prefill",
        model_dir,
        "kv_producer",
        0,
        {**common, "kv_port": free_port(), "run_dir": str(run_dirs["prefill"])},
        tmp / "prefill.log",
        args=(*args, "--max-num-batched-tokens", "256"),
    )
    decode = VLLMServer(
        "decode",
        model_dir,
        "kv_consumer",
        1,
        {**common, "run_dir": str(run_dirs["decode"])},
        tmp / "decode.log",
        args=args,
    )
    fleet = Fleet(tmp, scheduler, admin_token, prefill, decode, engine_token_file)
    try:
        prefill.start()
        decode.start()
        for role, server in (("prefill", prefill), ("decode", decode)):
            fleet.agents[role] = AgentProcess(role, server, run_dirs[role], fleet).start()
        _wait_ready_sampling(fleet)
        for agent in fleet.agents.values():
            fleet.wait_state(agent.instance_id, {"ready"}, timeout=120)
        yield fleet
    finally:
        for gateway in fleet.gateways:
            gateway.stop()
        for agent in fleet.agents.values():
            agent.stop()
        prefill.stop()
        decode.stop()
        scheduler.stop()


__all__ = ["API_KEY", "BLOCK_SIZE", "MODEL_NAME", "AgentProcess", "Fleet", "prompt_of", "start_fleet"]
