"""API keys per tenant, kept only as sha256 digests.

Keys file (JSON, or YAML when it ends in .yaml/.yml), tenant -> keys, or tenant -> keys plus limits:

    {"acme": ["sha256:9f86d08...", "a-plaintext-key"],
     "beta": {"keys": ["sha256:..."], "requests_per_second": 5, "request_burst": 10, "tokens_per_minute": 60000,
              "max_concurrent_requests": 16}}

An entry `sha256:<64 hex>` is a key's digest; any other entry is a plaintext key, hashed at load and then forgotten.
Prefer digests: `printf %s "$KEY" | sha256sum`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

log = logging.getLogger(__name__)
DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


class KeysFileError(ValueError):
    """The keys file is unreadable or malformed; the message names the tenant or entry."""


class TenantLimits(BaseModel):
    requests_per_second: float | None = Field(None, gt=0)
    request_burst: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent_requests: int | None = Field(None, ge=1)


class TenantEntry(TenantLimits):
    keys: list[str] = Field(min_length=1)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    """Maps a presented key's digest to its tenant."""

    def __init__(self, tenants: dict[str, TenantEntry]) -> None:
        self.limits: dict[str, TenantLimits] = {}
        self._tenant_by_digest: dict[str, str] = {}
        for tenant, entry in tenants.items():
            self.limits[tenant] = TenantLimits.model_validate(entry.model_dump(exclude={"keys"}))
            for key in entry.keys:
                match = DIGEST.match(key)
                self._tenant_by_digest[match.group(1) if match else digest(key)] = tenant

    @classmethod
    def from_file(cls, path: Path) -> KeyStore:
        raw = _parse(path)
        if not isinstance(raw, dict) or not raw:
            raise KeysFileError(f"{path}: expected a mapping tenant -> keys")
        tenants: dict[str, TenantEntry] = {}
        for tenant, value in raw.items():
            entry_data = {"keys": value} if isinstance(value, list) else value
            try:
                tenants[str(tenant)] = TenantEntry.model_validate(entry_data)
            except ValidationError as exc:
                where = ".".join(str(p) for p in exc.errors()[0]["loc"])
                raise KeysFileError(f"{path}: tenant {tenant!r}: {where}: {exc.errors()[0]['msg']}") from None
            plaintext = sum(1 for key in tenants[str(tenant)].keys if not DIGEST.match(key))
            if plaintext:
                log.warning(
                    "plaintext API keys in keys file; store sha256: digests instead",
                    extra={"fields": {"tenant": tenant, "plaintext_keys": plaintext}},
                )
        return cls(tenants)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant owning the bearer key in an Authorization header, or None."""
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return None
        return self._tenant_by_digest.get(digest(key))


def _parse(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeysFileError(f"api_keys_file {path}: {exc.strerror}") from None
    if path.suffix in (".yaml", ".yml"):
        import yaml  # noqa: PLC0415 - PyYAML is needed only for YAML keys files

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise KeysFileError(f"api_keys_file {path}: not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise KeysFileError(f"api_keys_file {path}: not valid JSON: {exc}") from None
