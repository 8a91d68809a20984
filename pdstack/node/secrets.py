"""Phase `secrets`: the node's secrets from Secrets Manager, through its instance role, as files for the roles.

Each stack secret the node reads (the contract's `node_secrets()`, named by `secret_name`) becomes a file named after
it under NODE_SECRETS_DIR (a tmpfs: read again at every boot, so a rotated secret is picked up by a reboot), and the
pool's certificate secret (JSON by file name: tls.crt, tls.key, ca.crt) its three files under tls/. Every value is
fetched before anything is written, each file is written whole (mode 0600, root), and no value is ever printed: a
failure names the secret, never its content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack.contract.components import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from pdstack.node.config import NodeConfig
from pdstack.node.files import write_atomic
from pdstack.node.loader import BootstrapError, Phase

TLS_FILES = (TLS_CERT_FILE, TLS_KEY_FILE, TLS_CA_FILE)


@dataclass(frozen=True)
class SecretFiles:
    secrets: dict[str, Path]  # stack secret -> its file
    tls: dict[str, Path]  # tls.crt, tls.key, ca.crt -> its file


def _value(secretsmanager: Any, secret_id: str) -> bytes:
    try:
        answer = secretsmanager.get_secret_value(SecretId=secret_id)
    except secretsmanager.exceptions.ResourceNotFoundException:
        raise BootstrapError(Phase.SECRETS, f"secret {secret_id} does not exist") from None
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
        raise BootstrapError(Phase.SECRETS, f"cannot read secret {secret_id}: {code}") from None
    if "SecretString" in answer:
        return str(answer["SecretString"]).encode()
    return bytes(answer["SecretBinary"])


def fetch_secrets(secretsmanager: Any, config: NodeConfig, secrets_dir: Path) -> SecretFiles:
    values = {name: _value(secretsmanager, secret_id) for name, secret_id in config.secrets.items()}
    try:
        tls = json.loads(_value(secretsmanager, config.tls_secret))
    except ValueError:
        raise BootstrapError(Phase.SECRETS, f"secret {config.tls_secret} is not JSON") from None
    if not isinstance(tls, dict) or sorted(tls) != sorted(TLS_FILES):
        raise BootstrapError(Phase.SECRETS, f"secret {config.tls_secret} must hold exactly {', '.join(TLS_FILES)}")
    secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (secrets_dir / "tls").mkdir(mode=0o700, exist_ok=True)
    files = SecretFiles(
        secrets={name: secrets_dir / name for name in values},
        tls={name: secrets_dir / "tls" / name for name in TLS_FILES},
    )
    for name, value in values.items():
        write_atomic(files.secrets[name], value, 0o600)
    for name in TLS_FILES:
        write_atomic(files.tls[name], str(tls[name]).encode(), 0o600)
    return files
