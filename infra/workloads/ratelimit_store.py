"""The gateways' shared rate-limit store: one in-cluster Redis, no persistence (a restart only forgets the current
windows' counts), reachable from the gateway pods alone (infra/workloads/access.py), over TLS only with a client
certificate from the environment's CA (the gateways present theirs), behind the ratelimit-store-password; its
redis.conf is a key of the environment's Secret.

Redis reads its certificate at start: a rotated one is served from the pod's next start. That is within the old
certificate's life, which a rotation leaves valid for its last EARLY_RENEWAL_DAYS (infra/certificates.py)."""

from __future__ import annotations

from typing import Any

import pulumi

from infra.workloads.common import (
    SECRET_FILE_MODE,
    SECRET_NAME,
    TLS_VOLUME,
    ControlWorkloadsArgs,
    single_pod,
    tls_volume,
)
from pdstack.contract.components import TLS_CA_FILE, TLS_CERT_FILE, TLS_DIR, TLS_KEY_FILE

RATELIMIT_STORE_IMAGE = "docker.io/library/redis:7.4.2-alpine"
RATELIMIT_STORE = "ratelimit"
RATELIMIT_STORE_UID = 999  # the image's redis user
RATELIMIT_STORE_CONFIG = "ratelimit-store-redis.conf"  # its key in the Secret: redis.conf with requirepass


def ratelimit_store(name: str, args: ControlWorkloadsArgs, opts: pulumi.ResourceOptions) -> None:
    port = args.contract.ratelimit_store.port
    container: dict[str, Any] = {
        "name": "redis",
        "image": RATELIMIT_STORE_IMAGE,
        "command": ["redis-server", "/etc/redis/redis.conf"],
        "ports": [{"name": "redis", "container_port": port}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "320Mi"}},
        "readiness_probe": {"tcp_socket": {"port": "redis"}, "period_seconds": 5},
        "liveness_probe": {"tcp_socket": {"port": "redis"}, "period_seconds": 15, "failure_threshold": 6},
        "volume_mounts": [
            {"name": "config", "mount_path": "/etc/redis", "read_only": True},
            {"name": "data", "mount_path": "/data"},
            {"name": TLS_VOLUME, "mount_path": TLS_DIR, "read_only": True},
        ],
    }
    volumes: list[Any] = [
        {
            "name": "config",
            "secret": {
                "secret_name": SECRET_NAME,
                "optional": False,
                "default_mode": SECRET_FILE_MODE,
                "items": [{"key": RATELIMIT_STORE_CONFIG, "path": "redis.conf"}],
            },
        },
        {"name": "data", "empty_dir": {}},
        tls_volume(RATELIMIT_STORE),
    ]
    single_pod(name, args, RATELIMIT_STORE, RATELIMIT_STORE_UID, container=container, volumes=volumes, opts=opts)


def ratelimit_store_config(password: str, port: int) -> str:
    """The in-cluster store's redis.conf: TLS only (no plaintext port) with client certificates from the CA, the
    password, no persistence, a memory ceiling (counters expire)."""
    tls = (
        f"port 0\ntls-port {port}\ntls-cert-file {TLS_DIR}/{TLS_CERT_FILE}\ntls-key-file {TLS_DIR}/{TLS_KEY_FILE}\n"
        f'tls-ca-cert-file {TLS_DIR}/{TLS_CA_FILE}\ntls-auth-clients yes\ntls-protocols "TLSv1.2 TLSv1.3"\n'
    )
    return (
        f'{tls}bind 0.0.0.0\nprotected-mode yes\nrequirepass {password}\nsave ""\n'
        "appendonly no\nmaxmemory 256mb\nmaxmemory-policy volatile-ttl\n"
    )
