"""The local environment's secrets: one file per stack secret, private, stable across runs, and exactly the files
the serving playbooks read from the secrets folder."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import yaml

from pdstack.local.secrets import LocalSecrets
from pdstack.model import REQUIRED_SECRETS
from tests.support import REPO


def test_ensure_makes_every_secret_private_and_distinct_then_keeps_them(tmp_path: Path) -> None:
    local = LocalSecrets(tmp_path / "secrets")
    local.ensure()
    values = [path.read_text() for path in local.generated()]
    assert len(local.generated()) == len(REQUIRED_SECRETS)
    assert len(set(values)) == len(values) and all(len(v) >= 32 for v in values)
    for path in (*local.generated(), local.api_keys):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(local.folder.stat().st_mode) == 0o700
    local.ensure()
    assert [path.read_text() for path in local.generated()] == values  # a second `up` rotates nothing


def test_the_playbooks_read_exactly_the_files_the_local_environment_writes(tmp_path: Path) -> None:
    local = LocalSecrets(tmp_path)
    written = {path.name for path in (*local.generated(), local.api_keys)} - {local.api_key.name}
    settings = yaml.safe_load((REPO / "playbooks" / "vars" / "serving.yml").read_text())
    read = {
        match
        for value in settings.values()
        if isinstance(value, str)
        for match in re.findall(r"\{\{ pdstack_secrets_dir \}\}/([\w.-]+)", value)
    }
    assert read == written
