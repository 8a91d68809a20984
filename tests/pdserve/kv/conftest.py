"""Fixtures for the KV channel tests."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv import KVMetrics, SecretKey


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "kv.key"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


@pytest.fixture
def key(key_file: Path) -> SecretKey:
    return SecretKey.from_file(key_file)


@pytest.fixture
def metrics() -> KVMetrics:
    return KVMetrics(CollectorRegistry())
