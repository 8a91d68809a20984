"""The control plane's Kubernetes workloads: gateway and scheduler Deployments running pdserve (command, PDSERVE_*
settings, secret files, ports and probes from the deployment contract, pdstack/contract.py; separate liveness and
readiness probes, resource requests, PodDisruptionBudgets, an autoscaler for the gateway), internal NLB Services open
only to the environment's networks, default-deny NetworkPolicies, the Secret from the secret store mounted as files,
Prometheus loading monitoring/alerts.yml, and the Alertmanager it sends alerts to.

Alerting is the project's own objects (a Deployment, ConfigMap and Service), not kube-prometheus-stack through a
Helm chart: one Alertmanager is all the rules need, the objects are typed, schema-checked and visible under Pulumi
mocks like every other one here (a chart renders only at deploy time), and no CRDs or operator join the cluster."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import yaml

from infra.control_plane import PROMETHEUS_SERVICE_ACCOUNT
from infra.prometheus import RULES_FILE, pods_service
from pdstack.contract import RUNTIME_UID, SECRET_FILES, SECRETS_DIR, STATE_DIR, Component, ComponentContract, Contract

PROMETHEUS_IMAGE = "quay.io/prometheus/prometheus:v3.5.0"
ALERTMANAGER_IMAGE = "quay.io/prometheus/alertmanager:v0.28.1"
PROMETHEUS_RETENTION = "15d"
PROMETHEUS_VOLUME_GIB = 100
SCHEDULER_STATE_CLAIM = "scheduler-state"
SCHEDULER_STATE_SIZE = "1Gi"  # one weights file; gp3's smallest volume
CONFIG_DIR = "/etc/pdstack"
SECRET_NAME = "pdstack-secrets"  # noqa: S105 (a Kubernetes object name)
# The key of that Secret holding the gateway's scheduler token (derived from the identity key for principal gateway)
GATEWAY_TOKEN = next(s.key for s in SECRET_FILES[Component.GATEWAY] if s.principal == "gateway")
# The gateways' shared rate-limit store: one in-cluster Redis, no persistence (a restart only forgets the current
# windows' counts), reachable from the gateway pods alone, behind the ratelimit-store-password.
RATELIMIT_STORE_IMAGE = "docker.io/library/redis:7.4.2-alpine"
RATELIMIT_STORE = "ratelimit"
RATELIMIT_STORE_UID = 999  # the image's redis user
RATELIMIT_STORE_CONFIG = "ratelimit-store-redis.conf"  # its key in the Secret: redis.conf with requirepass
# Read-only for everyone in the pod: the volume is the pod's own and its one container runs one non-root uid. Not 0440
# with fsGroup alone: runtimes that do not chown volumes to the fsGroup (podman kube play) would leave the files
# unreadable to that uid.
SECRET_FILE_MODE = 0o444
NLB_ANNOTATIONS = {
    "service.beta.kubernetes.io/aws-load-balancer-type": "nlb",
    "service.beta.kubernetes.io/aws-load-balancer-internal": "true",
    "service.beta.kubernetes.io/aws-load-balancer-cross-zone-load-balancing-enabled": "true",
}
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
    contract: Contract  # ports, commands, settings, secret files, probes, jobs (pdstack/contract.py)
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


@dataclass(frozen=True)
class AppSpec:
    name: str
    served: ComponentContract
    replicas: int
    cpu: str
    memory: str
    env: Mapping[str, str]  # PDSERVE_* settings, the secret files among them
    shared_store: bool = True

    @property
    def port(self) -> int:
        return self.served.port

    @property
    def secret_items(self) -> list[dict[str, str]]:
        return [{"key": s.key, "path": s.file} for s in self.served.secrets
                if self.shared_store or not s.only_with_shared_store]  # fmt: skip


def ingress_host(status: k8s.core.v1.outputs.ServiceStatus | None) -> str | None:
    """A LoadBalancer Service's address: the NLB's DNS name (or an address), None until it has one."""
    balancer = status.load_balancer if status is not None else None
    ingress = (balancer.ingress if balancer is not None else None) or []
    return next((i.hostname or i.ip for i in ingress if i.hostname or i.ip), None)


def load_balancer_url(status: k8s.core.v1.outputs.ServiceStatus | None, served: Contract) -> str | None:
    """The scheduler's URL behind its load balancer (the Service listens on the scheduler's own port)."""
    host = ingress_host(status)
    return None if host is None else served.scheduler_url(host)


def prometheus_load_balancer_url(status: k8s.core.v1.outputs.ServiceStatus | None, served: Contract) -> str | None:
    """Prometheus' URL behind its load balancer (the Service listens on Prometheus' own port)."""
    host = ingress_host(status)
    return None if host is None else served.prometheus_url(host)


def storage_class(env: str) -> str:
    """The environment's StorageClass: gp3 encrypted under its volume key (Prometheus' and the scheduler's data)."""
    return f"pdstack-{env}-gp3"


def prometheus_yaml(config: Mapping[str, Any]) -> str:
    text: str = yaml.safe_dump(dict(config), sort_keys=False)  # pyright: ignore[reportUnknownMemberType]  # partly untyped stub
    return text


def probes(port: str, live: str, ready: str) -> dict[str, Any]:
    """Liveness asks "is the process wedged" (slow to fire, restarts); readiness asks "may it take traffic now"
    (fast, removes it from the Service while the scheduler or a dependency is away)."""
    return {
        "liveness_probe": {
            "http_get": {"path": live, "port": port},
            "initial_delay_seconds": 10,
            "period_seconds": 10,
            "timeout_seconds": 2,
            "failure_threshold": 6,
        },
        "readiness_probe": {
            "http_get": {"path": ready, "port": port},
            "period_seconds": 5,
            "timeout_seconds": 2,
            "failure_threshold": 2,
        },
    }


class ControlWorkloads(pulumi.ComponentResource):
    def __init__(self, name: str, args: ControlWorkloadsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:control:ControlWorkloads", name, None, opts)
        self.args = args
        self.opts = pulumi.ResourceOptions(parent=self)
        ns = args.namespace
        k8s.core.v1.Namespace(
            f"{name}-ns",
            metadata={
                "name": ns,
                "labels": {"pod-security.kubernetes.io/enforce": "restricted", "pdstack/env": args.env},
            },
            opts=self.opts,
        )
        k8s.core.v1.Secret(
            f"{name}-secrets",
            metadata={"name": SECRET_NAME, "namespace": ns},
            type="Opaque",
            string_data=dict(args.secret_values),
            opts=self.opts,
        )
        k8s.core.v1.ConfigMap(
            f"{name}-config",
            metadata={"name": "pdstack-config", "namespace": ns},
            data=dict(args.config_files),
            opts=self.opts,
        )
        served = args.contract
        scheduler_url = f"http://scheduler.{ns}.svc.cluster.local:{served[Component.SCHEDULER].port}"
        gateway_contract = served[Component.GATEWAY]
        store = served.ratelimit_storage(f"{RATELIMIT_STORE}.{ns}.svc.cluster.local")
        gateway = AppSpec(
            "gateway",
            gateway_contract,
            args.gateway_replicas,
            "1",
            "1Gi",
            env={**gateway_contract.env(), "PDSERVE_SCHEDULER_URL": scheduler_url, "PDSERVE_RATE_LIMIT_STORAGE": store},
        )
        # One scheduler: its registry is soft state rebuilt from heartbeats within seconds; two replicas would
        # each see half the heartbeats behind the load balancer.
        scheduler_contract = served[Component.SCHEDULER]
        scheduler = AppSpec("scheduler", scheduler_contract, 1, "500m", "512Mi", env=scheduler_contract.env())
        for app in (gateway, scheduler):
            self._deployment(name, app, recreate=app is scheduler)
            k8s.policy.v1.PodDisruptionBudget(
                f"{name}-{app.name}",
                metadata={"name": app.name, "namespace": ns},
                spec={"max_unavailable": 1, "selector": {"match_labels": {"app": app.name}}},
                opts=self.opts,
            )
        k8s.autoscaling.v2.HorizontalPodAutoscaler(
            f"{name}-gateway",
            metadata={"name": "gateway", "namespace": ns},
            spec={
                "scale_target_ref": {"api_version": "apps/v1", "kind": "Deployment", "name": "gateway"},
                "min_replicas": args.gateway_replicas,
                "max_replicas": args.gateway_max_replicas,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {"name": "cpu", "target": {"type": "Utilization", "average_utilization": 70}},
                    }
                ],
            },
            opts=self.opts,
        )
        self._load_balancer(name, gateway, sources=[*args.client_cidrs])
        scheduler_service = self._load_balancer(
            name, scheduler, sources=[*args.datacenter_cidrs, *args.controller_cidrs]
        )
        # What the GPU nodes call: the scheduler's internal load balancer (known once AWS has made it)
        self.scheduler_url: pulumi.Output[str | None] = scheduler_service.status.apply(
            lambda status: load_balancer_url(status, served)
        )
        for app in (gateway, scheduler):
            self._pods_service(name, app)
        self._network_policies(name)
        # What the controller's canary judge queries: Prometheus' internal load balancer
        self.prometheus_url: pulumi.Output[str | None] = self._prometheus(name).status.apply(
            lambda status: prometheus_load_balancer_url(status, served)
        )
        self._alertmanager(name)
        self._ratelimit_store(name)
        self.register_outputs({})

    def _deployment(self, name: str, app: AppSpec, recreate: bool) -> None:
        labels = {"app": app.name, "pdstack/env": self.args.env}
        env: list[Any] = [{"name": k, "value": v} for k, v in app.env.items()]
        mounts: list[Any] = [
            {"name": "config", "mount_path": CONFIG_DIR, "read_only": True},
            {"name": "secrets", "mount_path": SECRETS_DIR, "read_only": True},
            {"name": "tmp", "mount_path": "/tmp"},  # noqa: S108 (a private emptyDir)
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
        ]
        if app.served.component is Component.SCHEDULER:
            # The weights file outlives the pod (the registry itself is soft state, rebuilt from heartbeats).
            mounts.append({"name": "state", "mount_path": STATE_DIR})
            volumes.append({"name": "state", "persistent_volume_claim": {"claim_name": self._state_claim(name)}})
        k8s.apps.v1.Deployment(  # dict args (built in parts): schema-checked in tests
            f"{name}-{app.name}",
            metadata={"name": app.name, "namespace": self.args.namespace, "labels": labels},
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
                                "image": self.args.images[app.name],
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
                                **probes("http", app.served.health_live, app.served.health_ready),
                            }
                        ],
                        "volumes": volumes,
                    },
                },
            },
            opts=self.opts,
        )

    def _state_claim(self, name: str) -> str:
        """The scheduler's weights volume: a PersistentVolumeClaim on the environment's encrypted gp3 class, not an
        emptyDir (lost with the pod, so a rescheduled scheduler would route by no weights until the next deploy)
        and not a ConfigMap (the scheduler would need API credentials and RBAC to write its own file). One
        ReadWriteOnce volume fits the one scheduler replica and its Recreate strategy: the old pod lets go of the
        volume before the new one mounts it. The cost: the pod stays in the volume's zone."""
        k8s.core.v1.PersistentVolumeClaim(
            f"{name}-{SCHEDULER_STATE_CLAIM}",
            metadata={"name": SCHEDULER_STATE_CLAIM, "namespace": self.args.namespace},
            spec={
                "access_modes": ["ReadWriteOnce"],
                "storage_class_name": storage_class(self.args.env),
                "resources": {"requests": {"storage": SCHEDULER_STATE_SIZE}},
            },
            opts=self.opts,
        )
        return SCHEDULER_STATE_CLAIM

    def _pods_service(self, name: str, app: AppSpec) -> None:
        """Headless: its DNS name resolves to every pod, ready or not, which is how Prometheus finds them."""
        k8s.core.v1.Service(
            f"{name}-{pods_service(app.name)}",
            metadata={"name": pods_service(app.name), "namespace": self.args.namespace},
            spec={
                "cluster_ip": "None",
                "publish_not_ready_addresses": True,
                "selector": {"app": app.name},
                "ports": [{"name": "http", "port": app.port, "target_port": "http", "protocol": "TCP"}],
            },
            opts=self.opts,
        )

    def _load_balancer(self, name: str, app: AppSpec, sources: list[str]) -> k8s.core.v1.Service:
        return self._internal_load_balancer(name, app.name, app.port, sources)

    def _internal_load_balancer(self, name: str, app: str, port: int, sources: list[str]) -> k8s.core.v1.Service:
        """An internal NLB on the pods of `app`, admitting only `sources` (the node security-group rules the
        cloud controller makes from loadBalancerSourceRanges; the app's NetworkPolicy admits the same blocks)."""
        return k8s.core.v1.Service(
            f"{name}-{app}",
            metadata={"name": app, "namespace": self.args.namespace, "annotations": NLB_ANNOTATIONS},
            spec={
                "type": "LoadBalancer",
                "external_traffic_policy": "Local",  # keeps the client address for rate limits, logs and policies
                "load_balancer_source_ranges": sorted(set(sources)),
                "selector": {"app": app},
                "ports": [{"name": "http", "port": port, "target_port": "http", "protocol": "TCP"}],
            },
            opts=self.opts,
        )

    def _network_policies(self, name: str) -> None:
        a, ns = self.args, self.args.namespace

        def policy(suffix: str, selector: dict[str, Any], ingress: list[Any]) -> None:
            k8s.networking.v1.NetworkPolicy(  # dict args (built in parts): schema-checked in tests
                f"{name}-{suffix}",
                metadata={"name": suffix, "namespace": ns},
                spec={"pod_selector": selector, "policy_types": ["Ingress"], "ingress": ingress},  # pyright: ignore[reportArgumentType]
                opts=self.opts,
            )

        def blocks(cidrs: Sequence[str]) -> list[Any]:
            return [{"ip_block": {"cidr": c}} for c in sorted({*cidrs, a.cluster_cidr})]

        policy("default-deny-ingress", {}, [])
        gateway_port = a.contract[Component.GATEWAY].port
        policy(
            "gateway",
            {"match_labels": {"app": "gateway"}},
            [{"from": blocks(a.client_cidrs), "ports": [{"port": gateway_port, "protocol": "TCP"}]}],
        )
        policy(
            "scheduler",
            {"match_labels": {"app": "scheduler"}},
            [
                {
                    "from": [
                        {"pod_selector": {"match_labels": {"app": "gateway"}}},
                        {"pod_selector": {"match_labels": {"app": "prometheus"}}},
                        *blocks(a.datacenter_cidrs),
                    ],
                    "ports": [{"port": a.contract[Component.SCHEDULER].port, "protocol": "TCP"}],
                },
            ],
        )
        policy(
            "gateway-metrics",
            {"match_labels": {"app": "gateway"}},
            [
                {
                    "from": [{"pod_selector": {"match_labels": {"app": "prometheus"}}}],
                    "ports": [{"port": gateway_port, "protocol": "TCP"}],
                },
            ],
        )
        policy(
            "prometheus",
            {"match_labels": {"app": "prometheus"}},
            [
                {
                    "from": [{"pod_selector": {}}, *blocks(a.controller_cidrs)],
                    "ports": [{"port": a.contract.prometheus.port, "protocol": "TCP"}],
                }
            ],
        )
        policy(
            RATELIMIT_STORE,
            {"match_labels": {"app": RATELIMIT_STORE}},
            [
                {
                    "from": [{"pod_selector": {"match_labels": {"app": "gateway"}}}],
                    "ports": [{"port": a.contract.ratelimit_store.port, "protocol": "TCP"}],
                }
            ],
        )
        policy(
            "alertmanager",
            {"match_labels": {"app": "alertmanager"}},
            [
                {
                    "from": [{"pod_selector": {"match_labels": {"app": "prometheus"}}}],
                    "ports": [{"port": a.contract.alertmanager.port, "protocol": "TCP"}],
                }
            ],
        )

    def _prometheus(self, name: str) -> k8s.core.v1.Service:
        a, ns = self.args, self.args.namespace
        labels = {"app": "prometheus"}
        k8s.core.v1.ServiceAccount(
            f"{name}-prometheus", metadata={"name": PROMETHEUS_SERVICE_ACCOUNT, "namespace": ns}, opts=self.opts
        )
        k8s.core.v1.ConfigMap(
            f"{name}-prometheus",
            metadata={"name": "prometheus", "namespace": ns},
            data={"prometheus.yml": prometheus_yaml(a.prometheus_config), RULES_FILE: a.alert_rules},
            opts=self.opts,
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
            opts=self.opts,
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
                                ],
                                "ports": [{"name": "http", "container_port": port}],
                                "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
                                "liveness_probe": {
                                    "http_get": {"path": a.contract.prometheus.health_live, "port": "http"},
                                    "period_seconds": 15,
                                    "failure_threshold": 6,
                                },
                                "readiness_probe": {
                                    "http_get": {"path": a.contract.prometheus.health_ready, "port": "http"},
                                    "period_seconds": 5,
                                    "failure_threshold": 3,
                                },
                                "volume_mounts": [
                                    {"name": "config", "mount_path": "/etc/prometheus", "read_only": True},
                                    {"name": "data", "mount_path": "/prometheus"},
                                ],
                                "security_context": RESTRICTED_CONTAINER,
                            }
                        ],
                        "volumes": [{"name": "config", "config_map": {"name": "prometheus"}}],
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
            opts=self.opts,
        )
        # In-cluster clients keep calling prometheus.<ns>.svc on its ClusterIP; the controller, outside the
        # cluster, calls its internal load balancer.
        return self._internal_load_balancer(name, "prometheus", port, [*a.controller_cidrs])

    def _alertmanager(self, name: str) -> None:
        a = self.args
        listener = a.contract.alertmanager
        # A Secret, not a ConfigMap: with a webhook the configuration holds its URL, which may carry a token.
        k8s.core.v1.Secret(
            f"{name}-alertmanager",
            metadata={"name": "alertmanager", "namespace": a.namespace},
            type="Opaque",
            string_data={"alertmanager.yml": a.alertmanager_config},
            opts=self.opts,
        )
        container: dict[str, Any] = {
            "name": "alertmanager",
            "image": ALERTMANAGER_IMAGE,
            "args": [
                "--config.file=/etc/alertmanager/alertmanager.yml",
                "--storage.path=/alertmanager",
                f"--web.listen-address=:{listener.port}",
            ],
            "ports": [{"name": "http", "container_port": listener.port}],
            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
            "liveness_probe": {
                "http_get": {"path": listener.health_live, "port": "http"},
                "period_seconds": 15,
                "failure_threshold": 6,
            },
            "readiness_probe": {
                "http_get": {"path": listener.health_ready, "port": "http"},
                "period_seconds": 5,
                "failure_threshold": 3,
            },
            "volume_mounts": [
                {"name": "config", "mount_path": "/etc/alertmanager", "read_only": True},
                {"name": "data", "mount_path": "/alertmanager"},
            ],
        }
        volumes: list[Any] = [
            {
                "name": "config",
                "secret": {"secret_name": "alertmanager", "optional": False, "default_mode": SECRET_FILE_MODE},
            },
            {"name": "data", "empty_dir": {}},
        ]
        self._single_pod(name, "alertmanager", 65534, container, volumes)

    def _ratelimit_store(self, name: str) -> None:
        port = self.args.contract.ratelimit_store.port
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
        self._single_pod(name, RATELIMIT_STORE, RATELIMIT_STORE_UID, container, volumes)

    def _single_pod(self, name: str, app: str, uid: int, container: dict[str, Any], volumes: list[Any]) -> None:
        """One replica (replaced, not rolled: it holds state) of a non-pdserve service, behind a ClusterIP Service
        on its container's first port."""
        ns, labels = self.args.namespace, {"app": app}
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
            opts=self.opts,
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
            opts=self.opts,
        )


def ratelimit_store_config(password: str, port: int) -> str:
    """The in-cluster store's redis.conf: the password, no persistence, a memory ceiling (counters expire)."""
    return (
        f'port {port}\nbind 0.0.0.0\nprotected-mode yes\nrequirepass {password}\nsave ""\n'
        "appendonly no\nmaxmemory 256mb\nmaxmemory-policy volatile-ttl\n"
    )
