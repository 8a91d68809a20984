"""Shared fixtures for the serving tests: tiny engine checkpoints made once per session (no binaries in git)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.testmodels import make_test_checkpoint

CheckpointFactory = Callable[..., Path]


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
