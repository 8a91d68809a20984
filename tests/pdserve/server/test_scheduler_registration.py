"""With --scheduler-url, a server registers with the pdserve scheduler and reports its load and KV fingerprint."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.scheduler.client import bearer
from pdserve.scheduler.identity import derive_token
from tests.support.ports import free_port
from tests.support.serverproc import ServerProcess

from .conftest import Deployment

ENGINE_ID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def scheduler_url(tmp_path: Path) -> Iterator[str]:
    for name in ("admin.token", "identity.key"):
        (tmp_path / name).write_text(secrets.token_hex(16))
    # The server's own principal token (contract §1), derived for the instance id it registers under.
    key = (tmp_path / "identity.key").read_text()
    (tmp_path / "instance.token").write_text(derive_token(key, f"instance:prefill-{ENGINE_ID[:24]}"))
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "scheduler",
            "--port",
            str(port),
            "--state-file",
            str(tmp_path / "state.json"),
            "--admin-token-file",
            str(tmp_path / "admin.token"),
            "--identity-key-file",
            str(tmp_path / "identity.key"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health/live", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def test_prefill_registers_with_the_scheduler(
    dense: Deployment, spawn: Callable[..., ServerProcess], scheduler_url: str, tmp_path: Path
) -> None:
    server = spawn(
        "prefill",
        dense.model,
        "--scheduler-url",
        scheduler_url,
        "--heartbeat-seconds",
        "0.2",
        "--scheduler-token-file",
        str(tmp_path / "instance.token"),
        "--engine-id",
        ENGINE_ID,
    )
    admin = bearer((tmp_path / "admin.token").read_text())
    info = server.ready_info()
    instances: list[dict[str, Any]] = []
    deadline = time.monotonic() + 20
    while not instances and time.monotonic() < deadline:
        instances = httpx.get(scheduler_url + "/v1/instances", headers=admin).json()["instances"]
        time.sleep(0.2)
    assert len(instances) == 1
    registered = instances[0]["info"]
    assert registered["role"] == "prefill"
    assert registered["kv_fingerprint"] == info["fingerprint"]
    assert registered["kv_port"] == info["kv_port"]
    assert registered["url"] == server.url
    # What the gateway needs to refuse what this server cannot honour (contract §4).
    assert registered["supported_params"] == []
    assert registered["max_model_len"] == 512
