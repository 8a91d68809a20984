"""Fixtures for the KV channel tests."""

from __future__ import annotations

import subprocess
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


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key."""
    folder = tmp_path_factory.mktemp("tls")
    cert, private_key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(private_key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, private_key
