"""Signed kv_transfer_params (pdserve.kv.params): the wire format of the contract, and every edit is caught."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from pdserve.kv.params import ParamsSignatureError, derive_params_key, sign, verify

KEY = b"0123456789abcdef0123456789abcdef"
PARAMS = {
    "do_remote_prefill": True,
    "remote_host": "10.0.0.5",
    "remote_port": 14579,
    "remote_block_ids": [],
    "remote_request_id": "r-1",
    "num_tokens": 7,
}


def test_signature_is_the_contract_hmac() -> None:
    canonical = json.dumps(PARAMS, sort_keys=True, separators=(",", ":")).encode()
    expected = hmac.new(KEY, b"pdstack-kv-params\0" + canonical, hashlib.sha256).hexdigest()
    assert sign(KEY, PARAMS) == {**PARAMS, "pdstack_signature": expected}


def test_signed_params_verify_after_a_json_round_trip() -> None:
    signed = json.loads(json.dumps(sign(KEY, PARAMS)))
    assert verify(KEY, signed) == signed


@pytest.mark.parametrize(
    "edit",
    [
        {"remote_host": "127.0.0.1"},
        {"remote_port": 1},
        {"remote_request_id": "r-2"},
        {"extra": 1},
        {"pdstack_signature": "0" * 64},
        {"pdstack_signature": 5},
    ],
)
def test_any_edit_fails_naming_the_signature(edit: dict[str, object]) -> None:
    with pytest.raises(ParamsSignatureError, match=r"kv_transfer_params\.pdstack_signature") as caught:
        verify(KEY, {**sign(KEY, PARAMS), **edit})
    assert caught.value.param == "kv_transfer_params.pdstack_signature"


def test_unsigned_and_other_key_fail() -> None:
    with pytest.raises(ParamsSignatureError, match="missing"):
        verify(KEY, PARAMS)
    with pytest.raises(ParamsSignatureError, match="does not match"):
        verify(KEY, sign(b"another key, also 32 bytes long!", PARAMS))


def test_params_key_is_the_contract_derivation_and_not_the_channel_key() -> None:
    derived = derive_params_key(KEY)
    assert derived == hmac.new(KEY, b"pdstack kv_transfer_params v1", hashlib.sha256).digest()
    assert derived != KEY and derive_params_key(b"another key, also 32 bytes long!") != derived
    # Params signed with the derived key (as the gateway signs early-dispatch params) verify only under it.
    verify(derived, sign(derived, PARAMS))
    with pytest.raises(ParamsSignatureError, match="does not match"):
        verify(derived, sign(KEY, PARAMS))


def test_params_key_needs_a_channel_key() -> None:
    with pytest.raises(ValueError, match="kv_key_material"):
        derive_params_key(b"")
