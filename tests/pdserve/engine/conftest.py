from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import Engine
from tests.support.fixtures import CheckpointFactory

KINDS = ("dense", "moe", "hybrid")


@pytest.fixture(scope="session")
def load_engine(make_checkpoint: CheckpointFactory):  # type: ignore[no-untyped-def]
    engines: dict[Path, Engine] = {}

    def load(kind: str, dtype: str = "float32", **kwargs: object) -> Engine:
        path = make_checkpoint(kind, dtype, **kwargs)
        if path not in engines:
            engines[path] = Engine.load(path)
        return engines[path]

    return load


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)
