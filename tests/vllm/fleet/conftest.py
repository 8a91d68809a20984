"""One fleet (a scheduler, a vLLM prefill and decode with PdstackConnector, an agent for each) that every module of
this package shares: started once, stopped when the package's last test is done. Each module adds gateways of its
own (Fleet.routed_gateway, stopped with the module) and leaves the fleet as it found it (an agent it stopped is
started again)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.agenthelpers import Fleet, start_fleet


@pytest.fixture(scope="package")
def fleet(model_dir: Path, kv_key_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    yield from start_fleet(model_dir, kv_key_file, tmp_path_factory.mktemp("fleet"))
