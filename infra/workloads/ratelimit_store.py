"""The gateways' shared rate-limit store: one in-cluster Redis, no persistence (a restart only forgets the current
windows' counts), reachable from the gateway pods alone (infra/workloads/access.py), behind the
ratelimit-store-password; its redis.conf is a key of the environment's Secret."""

from __future__ import annotations

from typing import Any

import pulumi

from infra.workloads.common import SECRET_FILE_MODE, SECRET_NAME, ControlWorkloadsArgs, single_pod

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
    ]
    single_pod(name, args, RATELIMIT_STORE, RATELIMIT_STORE_UID, container=container, volumes=volumes, opts=opts)


def ratelimit_store_config(password: str, port: int) -> str:
    """The in-cluster store's redis.conf: the password, no persistence, a memory ceiling (counters expire)."""
    return (
        f'port {port}\nbind 0.0.0.0\nprotected-mode yes\nrequirepass {password}\nsave ""\n'
        "appendonly no\nmaxmemory 256mb\nmaxmemory-policy volatile-ttl\n"
    )
