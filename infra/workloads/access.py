"""Who reaches the control plane's pods, and how: internal NLB Services (TLS on every port, open only to the
environment's networks) and the default-deny NetworkPolicies admitting the same blocks; the load balancers'
addresses and the URLs at them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.workloads.common import ControlWorkloadsArgs
from infra.workloads.ratelimit_store import RATELIMIT_STORE
from pdstack.contract.components import Component
from pdstack.policy.core import NLB_TLS_CERT, NLB_TLS_POLICY, NLB_TLS_PORTS, TLS_PASSTHROUGH

NLB_ANNOTATIONS = {
    "service.beta.kubernetes.io/aws-load-balancer-type": "nlb",
    "service.beta.kubernetes.io/aws-load-balancer-internal": "true",
    "service.beta.kubernetes.io/aws-load-balancer-cross-zone-load-balancing-enabled": "true",
}
# Every internal load balancer listens with TLS (the annotations are the tls-listeners policy's, pdstack.policy): the
# certificate its app's name carries (infra/certificates.py, imported into ACM) on every port, TLS 1.2 or 1.3 only.
NLB_TLS_POLICY_NAME = "ELBSecurityPolicy-TLS13-1-2-2021-06"
# and re-encrypts to the pods, which listen with TLS themselves (the NLB does not verify their certificates: the
# clients inside the cluster and the other components do)
NLB_BACKEND = "service.beta.kubernetes.io/aws-load-balancer-backend-protocol"
# Under the stack's mutual TLS a listener that requires its callers' certificates (the scheduler, Prometheus) must
# see them: its load balancer passes TLS through to the pods (a TCP listener, TLS_PASSTHROUGH said on the Service)
# and the pods end it themselves, with the certificate that carries the load balancer's name (infra/program.py
# component_names).


def ingress_host(status: k8s.core.v1.outputs.ServiceStatus | None) -> str | None:
    """A LoadBalancer Service's address: the NLB's DNS name (or an address), None until it has one."""
    balancer = status.load_balancer if status is not None else None
    ingress = (balancer.ingress if balancer is not None else None) or []
    return next((i.hostname or i.ip for i in ingress if i.hostname or i.ip), None)


def internal_load_balancer(
    name: str,
    args: ControlWorkloadsArgs,
    app: str,
    port: int,
    *,
    sources: list[str],
    opts: pulumi.ResourceOptions,
    passthrough: bool = False,
) -> k8s.core.v1.Service:
    """An internal NLB on the pods of `app`, admitting only `sources` (the node security-group rules the
    cloud controller makes from loadBalancerSourceRanges; the app's NetworkPolicy admits the same blocks); ending
    TLS itself, or with `passthrough` handing it to the pods."""
    tls = (
        {TLS_PASSTHROUGH: "true"}
        if passthrough
        else {
            NLB_TLS_CERT: args.load_balancer_certificates[app],
            NLB_TLS_PORTS: str(port),
            NLB_TLS_POLICY: NLB_TLS_POLICY_NAME,
            NLB_BACKEND: "ssl",
        }
    )
    annotations = {**NLB_ANNOTATIONS, **tls}
    return k8s.core.v1.Service(
        f"{name}-{app}",
        metadata={"name": app, "namespace": args.namespace, "annotations": annotations},
        spec={
            "type": "LoadBalancer",
            "external_traffic_policy": "Local",  # keeps the client address for rate limits, logs and policies
            "load_balancer_source_ranges": sorted(set(sources)),
            "selector": {"app": app},
            "ports": [{"name": "http", "port": port, "target_port": "http", "protocol": "TCP"}],
        },
        opts=opts,
    )


def network_policies(name: str, args: ControlWorkloadsArgs, opts: pulumi.ResourceOptions) -> None:
    a, ns = args, args.namespace

    def policy(suffix: str, selector: dict[str, Any], ingress: list[Any]) -> None:
        k8s.networking.v1.NetworkPolicy(  # dict args (built in parts): schema-checked in tests
            f"{name}-{suffix}",
            metadata={"name": suffix, "namespace": ns},
            spec={"pod_selector": selector, "policy_types": ["Ingress"], "ingress": ingress},  # pyright: ignore[reportArgumentType]
            opts=opts,
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
