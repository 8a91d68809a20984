"""KV faults on real sockets: decode never answers from bad KV; it recomputes or fails cleanly, per its policy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.kv import KVTransferError, SecretKey, pull
from pdserve.kv.params import derive_params_key, sign
from tests.support.serverproc import AUTH, ServerProcess, metric_value, prefill

from .conftest import Deployment
from .faultproxy import ByteFlipProxy

BODY = {
    "prompt": "the decode server pulls the cache from the prefill server over the network",
    "max_tokens": 10,
    "temperature": 0,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def expected(dense: Deployment) -> list[int]:
    answer = httpx.post(dense.colocated.url + "/v1/completions", json=BODY, timeout=60, headers=AUTH)
    return list(answer.json()["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def recompute_decode(dense: Deployment, spawn: Callable[..., ServerProcess]) -> ServerProcess:
    return spawn("decode", dense.model, "--kv-load-failure-policy", "recompute", "--kv-connect-timeout-seconds", "1")


def decode(server: ServerProcess, params: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions", json={**BODY, "kv_transfer_params": params}, timeout=60, headers=AUTH
    )


def resigned(params: dict[str, Any], key_file: Path, **edits: object) -> dict[str, Any]:
    """Params edited as a faulty prefill would have issued them (signed with the params key derived from the shared
    KV key), so that decode gets as far as the KV channel; edited and unsigned, decode refuses them before connecting
    (test_server_hardening)."""
    return sign(derive_params_key(SecretKey.from_file(key_file).material), {**params, **edits})


def assert_clean_failure(response: httpx.Response, cause: str) -> None:
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["type"] == "kv_load_failure"
    assert f"{cause}:" in error["message"]


def recomputed(server: ServerProcess, cause: str) -> float:
    return metric_value(server.metrics(), "pdserve_kv_load_failures_total", {"cause": cause, "action": "recompute"})


def test_flipped_byte_in_kv_stream_is_detected(
    dense: Deployment, recompute_decode: ServerProcess, expected: list[int], kv_key_file: Path
) -> None:
    for server in (dense.decode, recompute_decode):
        params = prefill(dense.prefill.url, BODY)
        proxy = ByteFlipProxy(int(params["remote_port"]), flip_at=1500).start()  # type: ignore[call-overload]
        try:
            response = decode(server, resigned(params, kv_key_file, remote_port=proxy.port))
        finally:
            proxy.close()
        assert proxy.flipped
        if server is dense.decode:
            assert_clean_failure(response, "checksum")
        else:
            assert response.status_code == 200
            assert response.json()["choices"][0]["token_ids"] == expected
    assert recomputed(recompute_decode, "checksum") >= 1


def test_prefill_killed_after_answering(
    dense: Deployment, recompute_decode: ServerProcess, spawn: Callable[..., ServerProcess], expected: list[int]
) -> None:
    doomed = spawn("prefill", dense.model)
    first, second = prefill(doomed.url, BODY), prefill(doomed.url, BODY)
    doomed.kill()
    assert_clean_failure(decode(dense.decode, first), "connection")
    response = decode(recompute_decode, second)
    assert response.status_code == 200
    assert response.json()["choices"][0]["token_ids"] == expected
    assert recomputed(recompute_decode, "connection") >= 1


def test_expired_lease(dense: Deployment, spawn: Callable[..., ServerProcess]) -> None:
    short_lease = spawn("prefill", dense.model, "--kv-lease-seconds", "0.3")
    params = prefill(short_lease.url, BODY)
    time.sleep(1.5)
    assert_clean_failure(decode(dense.decode, params), "expired")
    assert metric_value(short_lease.metrics(), "pdserve_kv_leases_released_total", {"reason": "expired"}) >= 1


def test_wrong_fingerprint(
    dense: Deployment,
    deployments: dict[str, Deployment],
    recompute_decode: ServerProcess,
    expected: list[int],
    kv_key_file: Path,
) -> None:
    tampered = resigned(prefill(dense.prefill.url, BODY), kv_key_file, kv_fingerprint="0" * 64)
    assert_clean_failure(decode(dense.decode, tampered), "fingerprint")
    other_model = deployments["moe"].decode  # same tokenizer, different weights: its fingerprint differs
    response = decode(other_model, prefill(dense.prefill.url, BODY))
    assert_clean_failure(response, "fingerprint")
    mismatched = resigned(prefill(dense.prefill.url, BODY), kv_key_file, kv_fingerprint="f" * 64)
    recovered = decode(recompute_decode, mismatched)
    assert recovered.json()["choices"][0]["token_ids"] == expected
    assert recomputed(recompute_decode, "fingerprint") >= 1


def pull_once(params: dict[str, object], key: SecretKey) -> None:
    """Pull the KV prefill's `params` name straight from its KV server, as a decode would, with no retry."""
    port, request_id, checksum = (str(params[name]) for name in ("remote_port", "remote_request_id", "kv_checksum"))
    asyncio.run(pull("127.0.0.1", int(port), request_id, checksum, key=key, retries=0))


def test_unauthenticated_kv_client_is_refused(dense: Deployment, tmp_path: Path, expected: list[int]) -> None:
    params = prefill(dense.prefill.url, BODY)
    refused_before = metric_value(dense.prefill.metrics(), "pdserve_kv_auth_refused_total")
    wrong_key = SecretKey(b"not-the-shared-key-at-all-0123456789")
    with pytest.raises(KVTransferError) as caught:
        pull_once(params, wrong_key)
    assert caught.value.cause == "auth"
    assert metric_value(dense.prefill.metrics(), "pdserve_kv_auth_refused_total") > refused_before
    # the KV stays held for the rightful decoder
    response = decode(dense.decode, params)
    assert response.json()["choices"][0]["token_ids"] == expected


def test_decoder_with_wrong_key_fails_cleanly(
    dense: Deployment, spawn: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    key_file = tmp_path / "other.key"
    key_file.write_text("a-different-key-0123456789abcdef")
    outsider = spawn("decode", dense.model, "--kv-key-file", str(key_file), key=False)
    # It cannot verify prefill's signature, so it refuses the params before connecting anywhere.
    refused = decode(outsider, prefill(dense.prefill.url, BODY))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "kv_transfer_params.pdstack_signature"


def test_kv_is_freed_once_decode_acknowledges(dense: Deployment, kv_key_file: Path) -> None:
    params = prefill(dense.prefill.url, BODY)
    acked_before = metric_value(dense.prefill.metrics(), "pdserve_kv_leases_released_total", {"reason": "ack"})
    assert decode(dense.decode, params).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        acked = metric_value(dense.prefill.metrics(), "pdserve_kv_leases_released_total", {"reason": "ack"})
        if acked > acked_before:
            break
        time.sleep(0.1)
    with pytest.raises(KVTransferError) as caught:
        pull_once(params, SecretKey.from_file(kv_key_file))
    assert caught.value.cause == "not_found"
