"""Signed kv_transfer_params: prefill signs what it returns, decode verifies it before connecting anywhere.

The params name the host and port decode pulls KV from, so they must come from a party holding the params key
(a prefill server, or the gateway for early dispatch), not from a client. The signature is an HMAC-SHA256 over the
canonical JSON of every other field (sorted keys, no spaces); any edit of any field (a host, a port, a request id)
breaks it.

The params key is derived from the KV channel key (`derive_params_key`), never the channel key itself: the gateway
is given only the derived key, so it can direct decode's pulls but cannot authenticate to any KV channel (the
channel's handshake is keyed by the channel key, and HMAC-SHA256 does not give the key back from the derived one).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIGNATURE_FIELD = "pdstack_signature"
_LABEL = b"pdstack-kv-params\0"
PARAMS_KEY_LABEL = b"pdstack kv_transfer_params v1"


def derive_params_key(kv_key_material: bytes) -> bytes:
    """The key that signs and verifies kv_transfer_params: HMAC-SHA256(kv channel key, PARAMS_KEY_LABEL)."""
    if not kv_key_material:
        raise ValueError("kv_key_material: must be the non-empty KV channel key")
    return hmac.new(kv_key_material, PARAMS_KEY_LABEL, hashlib.sha256).digest()


class ParamsSignatureError(ValueError):
    """kv_transfer_params without a valid signature; `param` names the field for the HTTP error."""

    param = "kv_transfer_params." + SIGNATURE_FIELD


def _canonical(params: dict[str, Any]) -> bytes:
    unsigned = {name: value for name, value in params.items() if name != SIGNATURE_FIELD}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def _mac(key: bytes, params: dict[str, Any]) -> str:
    return hmac.new(key, _LABEL + _canonical(params), hashlib.sha256).hexdigest()


def sign(key: bytes, params: dict[str, Any]) -> dict[str, Any]:
    """A copy of `params` with `pdstack_signature` added (replacing any signature already there)."""
    return {**{k: v for k, v in params.items() if k != SIGNATURE_FIELD}, SIGNATURE_FIELD: _mac(key, params)}


def verify(key: bytes, params: dict[str, Any]) -> dict[str, Any]:
    """`params` unchanged when its signature is right; raises ParamsSignatureError saying what is wrong."""
    received = params.get(SIGNATURE_FIELD)
    if received is None:
        raise ParamsSignatureError(
            f"kv_transfer_params.{SIGNATURE_FIELD}: missing (kv_transfer_params must be the ones a prefill server "
            "returned, unchanged)"
        )
    if not isinstance(received, str):
        raise ParamsSignatureError(f"kv_transfer_params.{SIGNATURE_FIELD}: must be a string")
    if not hmac.compare_digest(received.encode(), _mac(key, params).encode()):
        raise ParamsSignatureError(
            f"kv_transfer_params.{SIGNATURE_FIELD}: does not match the params (they were not issued by a prefill "
            "server sharing this server's KV channel key, or were changed since)"
        )
    return params
