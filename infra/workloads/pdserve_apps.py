"""The gateway and scheduler: Deployments running pdserve (command, PDSERVE_* settings, secret files, ports and
probes from the deployment contract, pdstack/contract/components.py; separate liveness and readiness probes, resource
requests), the scheduler's weights volume, and the headless Services Prometheus finds their pods by."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.prometheus import pods_service
from infra.workloads.common import (
    CONFIG_DIR,
    RESTRICTED_CONTAINER,
    SECRET_FILE_MODE,
    SECRET_NAME,
    TLS_VOLUME,
    ControlWorkloadsArgs,
    storage_class,
    tls_volume,
)
from pdstack.contract.components import (
    RUNTIME_UID,
    SECRETS_DIR,
    STATE_DIR,
    TLS_DIR,
    Component,
    ComponentContract,
    tls_probe_command,
)

SCHEDULER_STATE_CLAIM = "scheduler-state"
SCHEDULER_STATE_SIZE = "1Gi"  # one weights file; gp3's smallest volume


@dataclass(frozen=True)
class AppSpec:
    name: str
    served: ComponentContract
    replicas: int
    cpu: str
    memory: str
    env: Mapping[str, pulumi.Input[str]]  # PDSERVE_* settings, the secret files among them
    shared_store: bool = True

    @property
    def port(self) -> int:
        return self.served.port

    @property
    def secret_items(self) -> list[dict[str, str]]:
        return [
            {"key": s.key, "path": s.file}
            for s in self.served.secrets
            if self.shared_store or not s.only_with_shared_store
        ]


def probes(served: ComponentContract) -> dict[str, Any]:
    """Liveness asks "is the process wedged" (slow to fire, restarts); readiness asks "may it take traffic now"
    (fast, removes it from the Service while the scheduler or a dependency is away). Over the TLS listener (there
    is no plaintext port); one that requires a client certificate, which the kubelet has not, is probed from inside
    the pod presenting the pod's own."""

    def check(path: str) -> dict[str, Any]:
        if served.tls_client_auth == "required":
            return {"exec": {"command": tls_probe_command(served.port, path)}}
        return {"http_get": {"path": path, "port": "http", "scheme": "HTTPS"}}

    return {
        "liveness_probe": {
            **check(served.health_live),
            "initial_delay_seconds": 10,
            "period_seconds": 10,
            "timeout_seconds": 2,
            "failure_threshold": 6,
        },
        "readiness_probe": {
            **check(served.health_ready),
            "period_seconds": 5,
            "timeout_seconds": 2,
            "failure_threshold": 2,
        },
    }


def deployment(
    name: str, args: ControlWorkloadsArgs, app: AppSpec, recreate: bool, opts: pulumi.ResourceOptions
) -> None:
    labels = {"app": app.name, "pdstack/env": args.env}
    env: list[Any] = [{"name": k, "value": v} for k, v in app.env.items()]
    mounts: list[Any] = [
        {"name": "config", "mount_path": CONFIG_DIR, "read_only": True},
        {"name": "secrets", "mount_path": SECRETS_DIR, "read_only": True},
        {"name": "tmp", "mount_path": "/tmp"},  # noqa: S108 (a private emptyDir)
        {"name": TLS_VOLUME, "mount_path": TLS_DIR, "read_only": True},
    ]
    volumes: list[Any] = [
        {"name": "config", "config_map": {"name": "pdstack-config"}},
        # `optional: false` said out loud: a missing key must stop the pod, not start it without a credential
        {
            "name": "secrets",
            "secret": {
                "secret_name": SECRET_NAME,
                "optional": False,
                "default_mode": SECRET_FILE_MODE,
                "items": app.secret_items,
            },
        },
        {"name": "tmp", "empty_dir": {}},
        tls_volume(app.name),
    ]
    if app.served.component is Component.SCHEDULER:
        # The weights file outlives the pod (the registry itself is soft state, rebuilt from heartbeats).
        mounts.append({"name": "state", "mount_path": STATE_DIR})
        volumes.append({"name": "state", "persistent_volume_claim": {"claim_name": state_claim(name, args, opts)}})
    k8s.apps.v1.Deployment(  # dict args (built in parts): schema-checked in tests
        f"{name}-{app.name}",
        metadata={"name": app.name, "namespace": args.namespace, "labels": labels},
        spec={  # pyright: ignore[reportArgumentType]
            "replicas": app.replicas,
            "selector": {"match_labels": {"app": app.name}},
            "strategy": {"type": "Recreate"}
            if recreate
            else {"type": "RollingUpdate", "rolling_update": {"max_unavailable": 0, "max_surge": 1}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "security_context": {
                        "run_as_non_root": True,
                        "run_as_user": RUNTIME_UID,
                        "run_as_group": RUNTIME_UID,
                        "fs_group": RUNTIME_UID,
                        "seccomp_profile": {"type": "RuntimeDefault"},
                    },
                    "topology_spread_constraints": [
                        {
                            "max_skew": 1,
                            "topology_key": "topology.kubernetes.io/zone",
                            "when_unsatisfiable": "ScheduleAnyway",
                            "label_selector": {"match_labels": {"app": app.name}},
                        }
                    ],
                    "termination_grace_period_seconds": 60,  # let streams in flight finish
                    "containers": [
                        {
                            "name": app.name,
                            "image": args.images[app.name],
                            "command": list(app.served.command[:1]),
                            "args": list(app.served.args),
                            "ports": [{"name": "http", "container_port": app.port}],
                            "env": env,
                            "resources": {
                                "requests": {"cpu": app.cpu, "memory": app.memory},
                                "limits": {"memory": app.memory},
                            },
                            "volume_mounts": mounts,
                            "security_context": RESTRICTED_CONTAINER,
                            **probes(app.served),
                        }
                    ],
                    "volumes": volumes,
                },
            },
        },
        opts=opts,
    )


def state_claim(name: str, args: ControlWorkloadsArgs, opts: pulumi.ResourceOptions) -> str:
    """The scheduler's weights volume: a PersistentVolumeClaim on the environment's encrypted gp3 class, not an
    emptyDir (lost with the pod, so a rescheduled scheduler would route by no weights until the next deploy)
    and not a ConfigMap (the scheduler would need API credentials and RBAC to write its own file). One
    ReadWriteOnce volume fits the one scheduler replica and its Recreate strategy: the old pod lets go of the
    volume before the new one mounts it. The cost: the pod stays in the volume's zone."""
    k8s.core.v1.PersistentVolumeClaim(
        f"{name}-{SCHEDULER_STATE_CLAIM}",
        metadata={"name": SCHEDULER_STATE_CLAIM, "namespace": args.namespace},
        spec={
            "access_modes": ["ReadWriteOnce"],
            "storage_class_name": storage_class(args.env),
            "resources": {"requests": {"storage": SCHEDULER_STATE_SIZE}},
        },
        opts=opts,
    )
    return SCHEDULER_STATE_CLAIM


def headless_service(name: str, args: ControlWorkloadsArgs, app: AppSpec, opts: pulumi.ResourceOptions) -> None:
    """Headless: its DNS name resolves to every pod, ready or not, which is how Prometheus finds them."""
    k8s.core.v1.Service(
        f"{name}-{pods_service(app.name)}",
        metadata={"name": pods_service(app.name), "namespace": args.namespace},
        spec={
            "cluster_ip": "None",
            "publish_not_ready_addresses": True,
            "selector": {"app": app.name},
            "ports": [{"name": "http", "port": app.port, "target_port": "http", "protocol": "TCP"}],
        },
        opts=opts,
    )
