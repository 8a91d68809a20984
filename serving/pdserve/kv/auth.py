"""Shared-key authentication: HMAC-SHA256 challenge-response in both directions; the key never crosses the wire."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from pdserve.kv.errors import KVTransferError

MIN_KEY_BYTES = 16
_SERVER_LABEL = b"pdkv1 server proof"
_CLIENT_LABEL = b"pdkv1 client proof"


class SecretKey:
    """Key material read from a secret file; its repr never shows the key."""

    def __init__(self, material: bytes) -> None:
        if len(material) < MIN_KEY_BYTES:
            raise ValueError(f"KV channel key: needs at least {MIN_KEY_BYTES} bytes, got {len(material)}")
        self._material = material

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SecretKey:
        secret_path = Path(path)
        try:
            material = secret_path.read_bytes().strip()
        except OSError as error:
            raise ValueError(f"KV channel key file {secret_path}: cannot read it ({error.strerror})") from error
        if len(material) < MIN_KEY_BYTES:
            raise ValueError(f"KV channel key file {secret_path}: needs at least {MIN_KEY_BYTES} bytes of key")
        return cls(material)

    def __repr__(self) -> str:
        return "SecretKey(***)"

    @property
    def material(self) -> bytes:
        """The raw key, for other MACs under the same secret (pdserve.kv.params signs kv_transfer_params)."""
        return self._material

    def proof(self, label: bytes, *parts: bytes) -> bytes:
        return hmac.new(self._material, label + b"".join(parts), "sha256").digest()


def new_nonce() -> bytes:
    return os.urandom(32)


def server_proof(key: SecretKey, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return key.proof(_SERVER_LABEL, client_nonce, server_nonce)


def client_proof(key: SecretKey, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return key.proof(_CLIENT_LABEL, server_nonce, client_nonce)


def verify(expected: bytes, received: bytes, who: str) -> None:
    if not hmac.compare_digest(expected, received):
        raise KVTransferError("auth", f"{who} did not prove knowledge of the shared key")
