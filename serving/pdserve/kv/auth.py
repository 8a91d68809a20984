"""Shared-key authentication: HMAC-SHA256 challenge-response in both directions; the key never crosses the wire.

Both sides then derive a session key from the key and both nonces, under which the server MACs what decode accepts
(END: the manifest it sent and the blob checksum), so without TLS an attacker on the path who rewrites KV, digests,
checksums and CRCs is still caught; fresh nonces make a MAC from another connection worthless here."""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path

from pdserve.kv.errors import KVTransferError

MIN_KEY_BYTES = 16
_SERVER_LABEL = b"pdkv1 server proof"
_CLIENT_LABEL = b"pdkv1 client proof"
_SESSION_LABEL = b"pdkv3 session key"
_END_LABEL = b"pdkv3 END"


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


def session_key(key: SecretKey, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return key.proof(_SESSION_LABEL, client_nonce, server_nonce)


def end_mac(session: bytes, manifest: bytes, request: dict[str, object], checksum: str, chunks: int) -> str:
    """The MAC a stream's END carries: over the manifest bytes that stream got, its PULL (id, stream, streams,
    first_row), the chunk count and the blob checksum, which pins every unit's digest and so every byte."""
    fields = json.dumps({"request": request, "checksum": checksum, "chunks": chunks}, sort_keys=True).encode()
    message = _END_LABEL + len(manifest).to_bytes(8, "big") + manifest + fields
    return hmac.new(session, message, "sha256").hexdigest()


def verify(expected: bytes, received: bytes, who: str) -> None:
    if not hmac.compare_digest(expected, received):
        raise KVTransferError("auth", f"{who} did not prove knowledge of the shared key")
