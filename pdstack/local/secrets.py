"""Secrets of the local environment, generated on this machine on first use and never printed.

They live as 0600 files under the environment's state folder; the playbooks hand them to the nodes as podman secrets.
Cloud environments take the same ones from Secrets Manager instead (infra/).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from pdstack.contract.components import gateway_keys_file

TENANT = "local"


@dataclass(frozen=True)
class LocalSecrets:
    folder: Path

    @property
    def api_key(self) -> Path:
        """The plaintext key a client presents (`Authorization: Bearer ...`)."""
        return self.folder / "api-key"

    @property
    def api_keys(self) -> Path:
        """The gateway's keys file: tenant -> sha256 digests only."""
        return self.folder / "api-keys.json"

    @property
    def kv_channel_key(self) -> Path:
        return self.folder / "kv-channel.key"

    @property
    def scheduler_admin_token(self) -> Path:
        return self.folder / "scheduler-admin.token"

    @property
    def scheduler_identity_key(self) -> Path:
        """The scheduler's identity key: the playbooks derive each server's and the gateway's own token from it on
        the controller; only the scheduler's node receives the key itself."""
        return self.folder / "scheduler-identity.key"

    @property
    def server_api_token(self) -> Path:
        """What prefill and decode require of every caller (the gateway presents it)."""
        return self.folder / "server-api.token"

    @property
    def ratelimit_store_password(self) -> Path:
        """The `requirepass` of the control node's Redis, where the gateway replicas keep their rate limits."""
        return self.folder / "ratelimit-store.password"

    @property
    def metrics_scrape_token(self) -> Path:
        """What the gateway's /metrics requires; Prometheus presents it (its gateway job's credentials_file)."""
        return self.folder / "metrics-scrape.token"

    def generated(self) -> tuple[Path, ...]:
        """Every random secret, one per stack secret of pdstack.model.REQUIRED_SECRETS (the API keys file is
        derived from `api_key`)."""
        return (
            self.api_key,
            self.kv_channel_key,
            self.scheduler_admin_token,
            self.scheduler_identity_key,
            self.server_api_token,
            self.ratelimit_store_password,
            self.metrics_scrape_token,
        )

    def ensure(self) -> None:
        """Create whatever is missing; keep what exists, so a second `up` rotates nothing."""
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        for path in self.generated():
            if not path.exists():
                _write_private(path, secrets.token_urlsafe(32))
        keys = gateway_keys_file(self.api_key.read_text(), TENANT)
        if not self.api_keys.exists() or self.api_keys.read_text() != keys:
            _write_private(self.api_keys, keys)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
