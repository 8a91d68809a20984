"""The standing adversarial suite: real pdserve processes on loopback, attacked in bounded ways.

Each module builds its own stack (scheduler, prefill, decode, gateway) with tests/support's harnesses; this file holds
the tiny checkpoint and the KV key they share.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from pdserve.engine.testmodels import make_test_checkpoint


@pytest.fixture(scope="session")
def security_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_checkpoint("dense", tmp_path_factory.mktemp("security-model"))


@pytest.fixture(scope="session")
def security_kv_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("security-secrets") / "kv.key"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path
