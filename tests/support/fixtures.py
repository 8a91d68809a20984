"""The fixtures every test folder may use (tests/conftest.py loads this module as a plugin): the repository's
example stacks copied for a test to edit, tiny engine checkpoints made once per session (no binaries in git), and the
session's KV channel key."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.testmodels import make_test_checkpoint
from tests.support import STACKS

CheckpointFactory = Callable[..., Path]


@pytest.fixture
def stacks_dir(tmp_path: Path) -> Path:
    """A private copy of stacks/ that a test may edit."""
    target = tmp_path / "stacks"
    shutil.copytree(STACKS, target)
    return target


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``make_checkpoint(kind, dtype="float32", **kwargs)``: a memoised test checkpoint directory."""
    made: dict[str, Path] = {}

    def factory(kind: str, dtype: str = "float32", **kwargs: Any) -> Path:
        key = repr((kind, dtype, sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"ckpt-{kind}-{dtype}")
            made[key] = make_test_checkpoint(kind, out, dtype=dtype, **kwargs)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def dense_checkpoint(make_checkpoint: CheckpointFactory) -> Path:
    return make_checkpoint("dense")


@pytest.fixture(scope="session")
def moe_checkpoint(make_checkpoint: CheckpointFactory) -> Path:
    return make_checkpoint("moe")


@pytest.fixture(scope="session")
def hybrid_checkpoint(make_checkpoint: CheckpointFactory) -> Path:
    return make_checkpoint("hybrid")


@pytest.fixture(scope="session")
def kv_key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The KV channel key file every prefill/decode pair, gateway cluster and vLLM connector of the session is
    started with (32 random bytes in hex, readable by its owner only, as the deployers write it)."""
    path = tmp_path_factory.mktemp("secrets") / "kv.key"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path
