"""Prefill and decode over a TLS-wrapped KV channel (self-signed certificate made with the openssl CLI)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support.serverproc import AUTH, ServerProcess, prefill

from .conftest import Deployment


def test_pd_over_tls_kv_channel(dense: Deployment, spawn: Callable[..., ServerProcess], tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    tls_prefill = spawn("prefill", dense.model, "--kv-tls-cert", str(cert), "--kv-tls-key", str(key))
    tls_decode = spawn("decode", dense.model, "--kv-tls-ca", str(cert), "--kv-tls-server-name", "localhost")
    body = {"prompt": "sealed in transit", "max_tokens": 6, "temperature": 0}
    expected = httpx.post(dense.colocated.url + "/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
    decoded = httpx.post(
        tls_decode.url + "/v1/completions",
        headers=AUTH,
        json={**body, "kv_transfer_params": prefill(tls_prefill.url, body)},
        timeout=60,
    )
    assert decoded.json()["choices"][0]["text"] == expected
    # a decoder that does not speak TLS to it gets no KV
    plain = httpx.post(
        dense.decode.url + "/v1/completions",
        headers=AUTH,
        json={**body, "kv_transfer_params": prefill(tls_prefill.url, body)},
        timeout=60,
    )
    assert plain.status_code == 502
