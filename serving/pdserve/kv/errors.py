"""Errors of the KV channel, each naming its cause so decode can choose recompute or fail."""

from __future__ import annotations

from typing import Literal

Cause = Literal[
    "checksum", "auth", "timeout", "not_found", "expired", "connection", "fingerprint", "protocol", "capacity"
]


class KVTransferError(Exception):
    """A KV transfer or lease operation failed; `cause` says why in one machine-readable word."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause: Cause = cause
        self.message = message
