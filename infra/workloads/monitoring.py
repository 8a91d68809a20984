"""Monitoring in the cluster: Prometheus (a StatefulSet on the environment's encrypted gp3 class, loading
monitoring/alerts.yml, behind an internal load balancer for the controller's canary judge) and the Alertmanager it
sends alerts to.

Alerting is the project's own objects (a Deployment, ConfigMap and Service), not kube-prometheus-stack through a
Helm chart: one Alertmanager is all the rules need, the objects are typed, schema-checked and visible under Pulumi
mocks like every other one here (a chart renders only at deploy time), and no CRDs or operator join the cluster."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from infra.control_plane import PROMETHEUS_SERVICE_ACCOUNT
from infra.prometheus import RULES_FILE, WEB_CONFIG_FILE, web_config
from infra.workloads.access import internal_load_balancer
from infra.workloads.common import (
    RESTRICTED_CONTAINER,
    SECRET_FILE_MODE,
    SECRET_NAME,
    TLS_VOLUME,
    ControlWorkloadsArgs,
    single_pod,
    storage_class,
    tls_volume,
)
from pdstack.contract.components import SECRETS_DIR, TLS_DIR, Contract

PROMETHEUS_IMAGE = "quay.io/prometheus/prometheus:v3.5.0"
ALERTMANAGER_IMAGE = "quay.io/prometheus/alertmanager:v0.28.1"
PROMETHEUS_RETENTION = "15d"
PROMETHEUS_VOLUME_GIB = 100


def prometheus_yaml(config: Mapping[str, Any]) -> str:
    text: str = yaml.safe_dump(dict(config), sort_keys=False)  # pyright: ignore[reportUnknownMemberType]  # partly untyped stub
    return text


def web_probes(port: str, live: str | None, ready: str | None, *, client_auth: bool) -> dict[str, Any]:
    """A Prometheus-family daemon's probes: its health paths over HTTPS, or, where its listener requires a client
    certificate (which the kubelet has not, and the image has no client to present one from inside), its port."""

    def check(path: str | None) -> dict[str, Any]:
        if client_auth or path is None:
            return {"tcp_socket": {"port": port}}
        return {"http_get": {"path": path, "port": port, "scheme": "HTTPS"}}

    return {
        "liveness_probe": {**check(live), "period_seconds": 15, "failure_threshold": 6},
        "readiness_probe": {**check(ready), "period_seconds": 5, "failure_threshold": 3},
    }


SCRAPE_CREDENTIALS = "scrape-credentials"


def scrape_credentials(contract: Contract) -> list[dict[str, str]]:
    """The environment Secret's keys Prometheus presents to its targets (the gateway's metrics token), as the files
    the contract's scrape groups name under SECRETS_DIR."""
    return [
        {"key": g.credentials.key, "path": g.credentials.file}
        for g in contract.scrape_groups
        if g.credentials is not None
    ]


def prometheus(name: str, args: ControlWorkloadsArgs, opts: pulumi.ResourceOptions) -> k8s.core.v1.Service:
    a, ns = args, args.namespace
    labels = {"app": "prometheus"}
    k8s.core.v1.ServiceAccount(
        f"{name}-prometheus", metadata={"name": PROMETHEUS_SERVICE_ACCOUNT, "namespace": ns}, opts=opts
    )
    k8s.core.v1.ConfigMap(
        f"{name}-prometheus",
        metadata={"name": "prometheus", "namespace": ns},
        data={
            "prometheus.yml": prometheus_yaml(a.prometheus_config),
            RULES_FILE: a.alert_rules,
            WEB_CONFIG_FILE: prometheus_yaml(web_config(client_auth=a.contract.mutual_tls)),
        },
        opts=opts,
    )
    k8s.storage.v1.StorageClass(
        f"{name}-gp3",
        metadata={"name": storage_class(a.env)},
        provisioner="ebs.csi.aws.com",
        parameters=pulumi.Output.from_input(a.volume_key_arn).apply(
            lambda arn: {"type": "gp3", "encrypted": "true", "kmsKeyId": arn}
        ),
        volume_binding_mode="WaitForFirstConsumer",
        allow_volume_expansion=True,
        reclaim_policy="Retain",
        opts=opts,
    )
    port = a.contract.prometheus.port
    k8s.apps.v1.StatefulSet(  # dict args (built in parts): schema-checked in tests
        f"{name}-prometheus",
        metadata={"name": "prometheus", "namespace": ns, "labels": labels},
        spec={  # pyright: ignore[reportArgumentType]
            "service_name": "prometheus",
            "replicas": 1,
            "selector": {"match_labels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "service_account_name": PROMETHEUS_SERVICE_ACCOUNT,
                    "security_context": {
                        "run_as_non_root": True,
                        "run_as_user": 65534,
                        "fs_group": 65534,
                        "seccomp_profile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "prometheus",
                            "image": PROMETHEUS_IMAGE,
                            "args": [
                                "--config.file=/etc/prometheus/prometheus.yml",
                                "--storage.tsdb.path=/prometheus",
                                f"--storage.tsdb.retention.time={PROMETHEUS_RETENTION}",
                                f"--web.listen-address=:{port}",
                                f"--web.config.file=/etc/prometheus/{WEB_CONFIG_FILE}",  # TLS (web_config)
                            ],
                            "ports": [{"name": "http", "container_port": port}],
                            "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
                            **web_probes(
                                "http",
                                a.contract.prometheus.health_live,
                                a.contract.prometheus.health_ready,
                                client_auth=a.contract.mutual_tls,
                            ),
                            "volume_mounts": [
                                {"name": "config", "mount_path": "/etc/prometheus", "read_only": True},
                                {"name": "data", "mount_path": "/prometheus"},
                                {"name": TLS_VOLUME, "mount_path": TLS_DIR, "read_only": True},
                                {"name": SCRAPE_CREDENTIALS, "mount_path": SECRETS_DIR, "read_only": True},
                            ],
                            "security_context": RESTRICTED_CONTAINER,
                        }
                    ],
                    "volumes": [
                        {"name": "config", "config_map": {"name": "prometheus"}},
                        tls_volume("prometheus"),
                        {
                            "name": SCRAPE_CREDENTIALS,
                            "secret": {
                                "secret_name": SECRET_NAME,
                                "optional": False,
                                "default_mode": SECRET_FILE_MODE,
                                "items": scrape_credentials(a.contract),
                            },
                        },
                    ],
                },
            },
            "volume_claim_templates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "access_modes": ["ReadWriteOnce"],
                        "storage_class_name": storage_class(a.env),
                        "resources": {"requests": {"storage": f"{PROMETHEUS_VOLUME_GIB}Gi"}},
                    },
                }
            ],
        },
        opts=opts,
    )
    # In-cluster clients keep calling prometheus.<ns>.svc on its ClusterIP; the controller, outside the
    # cluster, calls its internal load balancer.
    return internal_load_balancer(
        name, a, "prometheus", port, sources=[*a.controller_cidrs], opts=opts, passthrough=a.contract.mutual_tls
    )


def alertmanager(name: str, args: ControlWorkloadsArgs, opts: pulumi.ResourceOptions) -> None:
    a = args
    listener = a.contract.alertmanager
    # A Secret, not a ConfigMap: with a webhook the configuration holds its URL, which may carry a token.
    k8s.core.v1.Secret(
        f"{name}-alertmanager",
        metadata={"name": "alertmanager", "namespace": a.namespace},
        type="Opaque",
        string_data={"alertmanager.yml": a.alertmanager_config, WEB_CONFIG_FILE: prometheus_yaml(web_config(True))},
        opts=opts,
    )
    container: dict[str, Any] = {
        "name": "alertmanager",
        "image": ALERTMANAGER_IMAGE,
        "args": [
            "--config.file=/etc/alertmanager/alertmanager.yml",
            "--storage.path=/alertmanager",
            f"--web.listen-address=:{listener.port}",
            # TLS, and only Prometheus' client certificate (or another from the CA) may post alerts or silences
            f"--web.config.file=/etc/alertmanager/{WEB_CONFIG_FILE}",
        ],
        "ports": [{"name": "https", "container_port": listener.port}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        # TCP probes: the kubelet has no client certificate to present, and Alertmanager requires one.
        **web_probes("https", listener.health_live, listener.health_ready, client_auth=True),
        "volume_mounts": [
            {"name": "config", "mount_path": "/etc/alertmanager", "read_only": True},
            {"name": "data", "mount_path": "/alertmanager"},
            {"name": TLS_VOLUME, "mount_path": TLS_DIR, "read_only": True},
        ],
    }
    volumes: list[Any] = [
        {
            "name": "config",
            "secret": {"secret_name": "alertmanager", "optional": False, "default_mode": SECRET_FILE_MODE},
        },
        {"name": "data", "empty_dir": {}},
        tls_volume("alertmanager"),
    ]
    single_pod(name, args, "alertmanager", 65534, container=container, volumes=volumes, opts=opts)
