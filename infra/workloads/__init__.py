"""The control plane's Kubernetes workloads, one component (ControlWorkloads) built in parts by concern:

- common.py: the component's arguments and what the parts share (the Secret's name, the TLS volume, the restricted
  security context, the one-replica pod of the non-pdserve services);
- pdserve_apps.py: the gateway and scheduler Deployments running pdserve (command, PDSERVE_* settings, secret
  files, ports and probes from the deployment contract, pdstack/contract/components.py), the scheduler's weights volume
  and the headless Services Prometheus finds the pods by;
- access.py: the internal NLB Services open only to the environment's networks, and default-deny NetworkPolicies;
- monitoring.py: Prometheus loading monitoring/alerts.yml, and the Alertmanager it sends alerts to;
- ratelimit_store.py: the gateways' shared rate-limit store (Redis).

This module makes the namespace, the Secret from the secret store mounted as files, the ConfigMap, the TLS Secrets,
the PodDisruptionBudgets and the gateway's autoscaler, and calls the parts. Every object's parent is the one
ControlWorkloads component, as before the split: the parts are functions, not components of their own, so no
object's URN changed."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from infra.workloads.access import internal_load_balancer, network_policies
from infra.workloads.common import SECRET_NAME, ControlWorkloadsArgs, https_url, tls_secret
from infra.workloads.monitoring import alertmanager, prometheus
from infra.workloads.pdserve_apps import AppSpec, deployment, headless_service
from infra.workloads.ratelimit_store import RATELIMIT_STORE, ratelimit_store
from pdstack.contract.components import Component, cluster_service_name


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
        for app, files in args.tls.items():
            k8s.core.v1.Secret(
                f"{name}-{tls_secret(app)}",
                metadata={"name": tls_secret(app), "namespace": ns},
                type="kubernetes.io/tls",
                string_data=files.files(),  # the key is a secret Output: so is the whole of stringData
                opts=self.opts,
            )
        served = args.contract
        # the name the scheduler's certificate carries (infra/program.component_names)
        scheduler_url = https_url(cluster_service_name("scheduler", ns), served[Component.SCHEDULER].port)
        gateway_contract = served[Component.GATEWAY]
        store = served.ratelimit_storage(cluster_service_name(RATELIMIT_STORE, ns))
        gateway = AppSpec(
            "gateway",
            gateway_contract,
            args.gateway_replicas,
            "1",
            "1Gi",
            env={
                **gateway_contract.env(),
                **gateway_contract.tls_env(),
                "PDSERVE_SCHEDULER_URL": scheduler_url,
                "PDSERVE_RATE_LIMIT_STORAGE": store,
            },
        )
        # One scheduler: its registry is soft state rebuilt from heartbeats within seconds; two replicas would
        # each see half the heartbeats behind the load balancer.
        scheduler_contract = served[Component.SCHEDULER]
        scheduler = AppSpec(
            "scheduler",
            scheduler_contract,
            1,
            "500m",
            "512Mi",
            env={**scheduler_contract.env(), **scheduler_contract.tls_env(), **args.scheduler_join},
        )
        for app in (gateway, scheduler):
            deployment(name, args, app, recreate=app is scheduler, opts=self.opts)
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
        self.services: dict[str, k8s.core.v1.Service] = {}
        self.services["gateway"] = internal_load_balancer(
            name, args, gateway.name, gateway.port, sources=[*args.client_cidrs], opts=self.opts
        )
        self.services["scheduler"] = internal_load_balancer(
            name,
            args,
            scheduler.name,
            scheduler.port,
            sources=[*args.datacenter_cidrs, *args.controller_cidrs],
            opts=self.opts,
            passthrough=args.contract.mutual_tls,
        )
        # What the GPU nodes call: the scheduler's internal load balancer, by its name (infra/dns.py points it there)
        self.scheduler_url = https_url(args.dns_names["scheduler"], scheduler.port)
        for app in (gateway, scheduler):
            headless_service(name, args, app, self.opts)
        network_policies(name, args, self.opts)
        # What the controller's canary judge queries: Prometheus' internal load balancer
        self.services["prometheus"] = prometheus(name, args, self.opts)
        self.prometheus_url = https_url(args.dns_names["prometheus"], served.prometheus.port)
        alertmanager(name, args, self.opts)
        ratelimit_store(name, args, self.opts)
        self.register_outputs({})
