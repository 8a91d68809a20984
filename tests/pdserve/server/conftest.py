"""Session-wide pdserve servers: for each test architecture a colocated server and a prefill -> decode pair."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.serverproc import ServerProcess, start_all

KINDS = ("dense", "moe", "hybrid")


@dataclass
class Deployment:
    colocated: ServerProcess
    prefill: ServerProcess
    decode: ServerProcess
    model: Path


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def spawn(server_logs: Path, kv_key_file: Path) -> Iterator[Callable[..., ServerProcess]]:
    """spawn(role, model, *args, ready=True, key=True, env=None): a server process stopped at session end."""
    started: list[ServerProcess] = []

    def factory(
        role: str, model: Path, *args: str, ready: bool = True, key: bool = True, env: dict[str, str] | None = None
    ) -> ServerProcess:
        extra = list(args)
        if key and role != "colocated":
            extra += ["--kv-key-file", str(kv_key_file)]
        if role == "prefill" and "--kv-port" not in extra:
            extra += ["--kv-port", "0"]
        server = ServerProcess(role, model, extra, env or {}, server_logs / f"{role}-{len(started)}.log")
        started.append(server)
        server.start()
        return server.wait_ready() if ready else server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def deployments(
    make_checkpoint: Callable[..., Path], server_logs: Path, kv_key_file: Path
) -> Iterator[dict[str, Deployment]]:
    """All nine servers start together so their model loads overlap."""
    found: dict[str, Deployment] = {}
    servers: list[ServerProcess] = []
    for kind in KINDS:
        model = make_checkpoint(kind)
        key = ["--kv-key-file", str(kv_key_file)]
        trio = [
            ServerProcess("colocated", model, [], {}, server_logs / f"{kind}-colocated.log"),
            ServerProcess("prefill", model, [*key, "--kv-port", "0"], {}, server_logs / f"{kind}-prefill.log"),
            ServerProcess(
                "decode", model, [*key, "--kv-load-failure-policy", "fail"], {}, server_logs / f"{kind}-decode.log"
            ),
        ]
        servers += trio
        found[kind] = Deployment(*trio, model=model)
    start_all(servers)
    yield found
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def dense(deployments: dict[str, Deployment]) -> Deployment:
    return deployments["dense"]
