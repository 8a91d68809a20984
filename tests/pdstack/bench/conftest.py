"""A real pdserve colocated server on loopback (tiny test checkpoint) and a helper that runs `pdstack bench` on it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.serverproc import ServerProcess

# short prompts are ~400 tokens with the test tokenizer; the stock 512-position test model would truncate them
CONTEXT = 2048

BenchRunner = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def bench_model(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("dense", overrides={"max_position_embeddings": CONTEXT})


def _serve(model: Path, log: Path, *args: str) -> Iterator[ServerProcess]:
    server = ServerProcess("colocated", model, list(args), {}, log)
    server.start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def colocated(bench_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(bench_model, tmp_path_factory.mktemp("bench-logs") / "colocated.log")


@pytest.fixture(scope="session")
def one_at_a_time(bench_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server that admits one request at a time and answers 429 to the rest."""
    yield from _serve(bench_model, tmp_path_factory.mktemp("bench-logs") / "single.log", "--max-num-seqs", "1")


def bench_process(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m pdstack bench --url URL ARGS...`, as a user would run it."""
    command = [sys.executable, "-m", "pdstack", "bench", "--url", url, *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def run_bench(tmp_path_factory: pytest.TempPathFactory) -> BenchRunner:
    """run_bench(url, *args): run `pdstack bench` to success and return its JSON results (plus its stdout)."""
    out_dir = tmp_path_factory.mktemp("bench-results")
    made = 0

    def run(url: str, *args: str) -> dict[str, Any]:
        nonlocal made
        made += 1
        path = out_dir / f"run-{made}.json"
        done = bench_process(url, "--json", str(path), *args)
        assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
        results: dict[str, Any] = json.loads(path.read_text())
        results["stdout"] = done.stdout
        return results

    return run
