"""Secrets of the local environment, generated on this machine on first use and never printed.

They live as 0600 files under the environment's state folder; the playbooks hand them to the nodes as podman secrets.
Cloud environments take the same ones from Secrets Manager instead (infra/).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

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
    def scheduler_instance_token(self) -> Path:
        """What servers present to the scheduler to register, heartbeat and drain."""
        return self.folder / "scheduler-instance.token"

    def ensure(self) -> None:
        """Create whatever is missing; keep what exists, so a second `up` rotates nothing."""
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        for path in (self.api_key, self.kv_channel_key, self.scheduler_admin_token, self.scheduler_instance_token):
            if not path.exists():
                _write_private(path, secrets.token_urlsafe(32))
        digest = hashlib.sha256(self.api_key.read_text().encode()).hexdigest()
        keys = json.dumps({TENANT: [f"sha256:{digest}"]}, indent=2) + "\n"
        if not self.api_keys.exists() or self.api_keys.read_text() != keys:
            _write_private(self.api_keys, keys)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
