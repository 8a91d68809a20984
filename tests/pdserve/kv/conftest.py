"""Fixtures for the KV channel tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv import KVMetrics, SecretKey
from tests.support.tlsfiles import self_signed_localhost


@pytest.fixture
def key(kv_key_file: Path) -> SecretKey:
    """The session's KV key (tests/support's kv_key_file)."""
    return SecretKey.from_file(kv_key_file)


@pytest.fixture
def metrics() -> KVMetrics:
    return KVMetrics(CollectorRegistry())


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key."""
    return self_signed_localhost(tmp_path_factory.mktemp("tls"))
