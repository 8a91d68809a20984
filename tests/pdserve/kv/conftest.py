"""Fixtures for the KV channel tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pdserve.kv import KVMetrics, SecretKey


@pytest.fixture
def key(kv_key_file: Path) -> SecretKey:
    """The session's KV key (tests/support's kv_key_file)."""
    return SecretKey.from_file(kv_key_file)


@pytest.fixture
def metrics() -> KVMetrics:
    return KVMetrics(CollectorRegistry())
