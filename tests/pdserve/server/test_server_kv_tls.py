"""Prefill and decode over a TLS-wrapped KV channel (self-signed certificate made with the openssl CLI)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support.serverproc import AUTH, ServerProcess, prefill
from tests.support.tlsfiles import self_signed_localhost

from .conftest import Deployment


def test_pd_over_tls_kv_channel(dense: Deployment, spawn: Callable[..., ServerProcess], tmp_path: Path) -> None:
    cert, key = self_signed_localhost(tmp_path)
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
