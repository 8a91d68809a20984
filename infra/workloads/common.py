"""What every part of the control plane's workloads shares: the component's arguments, the names of the objects the
parts refer to each other by (the Secret, the ConfigMap's mount, the TLS volume), the restricted security context,
and the one-replica pod the non-pdserve services run as (Alertmanager, the rate-limit store)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.certificates import TlsFiles
from pdstack.contract.components import SECRET_FILES, Component, Contract

CONFIG_DIR = "/etc/pdstack"
SECRET_NAME = "pdstack-secrets"  # noqa: S105 (a Kubernetes object name)
# The key of that Secret holding the gateway's scheduler token (derived from the identity key for principal gateway)
GATEWAY_TOKEN = next(s.key for s in SECRET_FILES[Component.GATEWAY] if s.principal == "gateway")
# Read-only for everyone in the pod: the volume is the pod's own and its one container runs one non-root uid. Not 0440
# with fsGroup alone: runtimes that do not chown volumes to the fsGroup (podman kube play) would leave the files
# unreadable to that uid.
SECRET_FILE_MODE = 0o444
TLS_VOLUME = "tls"
RESTRICTED_CONTAINER = {
    "allow_privilege_escalation": False,
    "read_only_root_filesystem": True,
    "run_as_non_root": True,
    "capabilities": {"drop": ["ALL"]},
    "seccomp_profile": {"type": "RuntimeDefault"},
}


@dataclass(frozen=True)
class ControlWorkloadsArgs:
    env: str
    namespace: str
    images: Mapping[str, pulumi.Input[str]]  # gateway, scheduler: full image references
    contract: Contract  # ports, commands, settings, secret files, probes, jobs (pdstack/contract/components.py)
    config_files: Mapping[str, str]  # file name -> content, mounted read-only at CONFIG_DIR
    secret_values: Mapping[str, pulumi.Input[str]]  # secret Outputs
    client_cidrs: Sequence[str]  # who may call the gateway: the environment's networks
    datacenter_cidrs: Sequence[str]  # who heartbeats to the scheduler: the serving datacenters
    # Where the controller (ansible-playbook) runs: the control VPC's management subnets. It calls the scheduler's
    # admin API (weights) and Prometheus (canary judge) through their load balancers, and the decode servers
    # (golden outputs) on ports the GPU nodes open to the control VPC only.
    controller_cidrs: Sequence[str]
    cluster_cidr: str  # the control VPC: NLB health checks come from it
    prometheus_config: Mapping[str, Any]
    alert_rules: str  # monitoring/alerts.yml, loaded by Prometheus
    alertmanager_config: pulumi.Input[str]  # alertmanager.yml, secret (infra/prometheus.alertmanager_yaml)
    volume_key_arn: pulumi.Input[str]
    gateway_replicas: int
    gateway_max_replicas: int
    # app (gateway, scheduler, prometheus) -> the ACM certificate of its load balancer's TLS listener
    load_balancer_certificates: Mapping[str, pulumi.Input[str]]
    # app -> its DNS name (pdstack.contract.components.Names): the URLs the control plane hands on name it, not an
    # address
    dns_names: Mapping[str, str]
    # app -> its certificate, key (secret) and CA: a kubernetes.io/tls Secret mounted at TLS_DIR
    tls: Mapping[str, TlsFiles]
    # The scheduler's join settings (PDSERVE_JOIN_*: node roles -> component, audience, region): how a self-joining
    # GPU node gets its own token (pdserve.scheduler.join); empty: join off
    scheduler_join: Mapping[str, pulumi.Input[str]] = field(default_factory=dict[str, "pulumi.Input[str]"])


def tls_secret(app: str) -> str:
    return f"{app}-tls"


def tls_volume(app: str) -> dict[str, Any]:
    """Its kubernetes.io/tls Secret: the kubelet swaps the files in place on rotation, and the component reloads
    them (pdserve.common.tls, Prometheus' web config) without a restart."""
    secret = {"secret_name": tls_secret(app), "optional": False, "default_mode": SECRET_FILE_MODE}
    return {"name": TLS_VOLUME, "secret": secret}


def https_url(name: str, port: int) -> str:
    """A load balancer's URL by its DNS name: it listens with TLS on the app's own port (NLB_TLS_PORTS)."""
    return f"https://{name}:{port}"


def storage_class(env: str) -> str:
    """The environment's StorageClass: gp3 encrypted under its volume key (Prometheus' and the scheduler's data)."""
    return f"pdstack-{env}-gp3"


def single_pod(
    name: str,
    args: ControlWorkloadsArgs,
    app: str,
    uid: int,
    *,
    container: dict[str, Any],
    volumes: list[Any],
    opts: pulumi.ResourceOptions,
) -> None:
    """One replica (replaced, not rolled: it holds state) of a non-pdserve service, behind a ClusterIP Service
    on its container's first port."""
    ns, labels = args.namespace, {"app": app}
    k8s.apps.v1.Deployment(  # dict args (built in parts): schema-checked in tests
        f"{name}-{app}",
        metadata={"name": app, "namespace": ns, "labels": labels},
        spec={  # pyright: ignore[reportArgumentType]
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"match_labels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "security_context": {
                        "run_as_non_root": True,
                        "run_as_user": uid,
                        "run_as_group": uid,
                        "fs_group": uid,
                        "seccomp_profile": {"type": "RuntimeDefault"},
                    },
                    "containers": [{**container, "security_context": RESTRICTED_CONTAINER}],
                    "volumes": volumes,
                },
            },
        },
        opts=opts,
    )
    port = container["ports"][0]
    k8s.core.v1.Service(
        f"{name}-{app}",
        metadata={"name": app, "namespace": ns},
        spec={
            "type": "ClusterIP",
            "selector": labels,
            "ports": [
                {
                    "name": port["name"],
                    "port": port["container_port"],
                    "target_port": port["name"],
                    "protocol": "TCP",
                }
            ],
        },
        opts=opts,
    )
