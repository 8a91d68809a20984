"""Prometheus's scrape configuration: the control-plane services through Kubernetes discovery, and every
datacenter's nodes through EC2 discovery keyed on the pdstack tags (so new Auto Scaling instances appear alone)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra.security import NODE_EXPORTER_PORT
from infra.tags import DC, ENV, POOL, ROLE
from pdstack.model import PoolRole, Ports

SCRAPE_INTERVAL = "15s"


@dataclass(frozen=True)
class DatacenterTarget:
    name: str
    region: str
    pool_roles: tuple[PoolRole, ...]


def _tag_label(tag: str) -> str:
    return "__meta_ec2_tag_" + tag.replace(":", "_")


def _ec2_job(job: str, env: str, dc: DatacenterTarget, port: int, role: PoolRole | None) -> dict[str, Any]:
    filters = [
        {"name": f"tag:{ENV}", "values": [env]},
        {"name": f"tag:{DC}", "values": [dc.name]},
        {"name": "instance-state-name", "values": ["running"]},
    ]
    if role is not None:
        filters.append({"name": f"tag:{ROLE}", "values": [str(role)]})
    return {
        "job_name": job,
        "ec2_sd_configs": [{"region": dc.region, "port": port, "filters": filters}],
        "relabel_configs": [
            {"source_labels": [_tag_label(DC)], "target_label": "datacenter"},
            {"source_labels": [_tag_label(ROLE)], "target_label": "role"},
            {"source_labels": [_tag_label(POOL)], "target_label": "pool"},
            {"source_labels": ["__meta_ec2_instance_id"], "target_label": "instance_id"},
            {"source_labels": ["__meta_ec2_availability_zone"], "target_label": "zone"},
        ],
    }


def _service_job(name: str, namespace: str) -> dict[str, Any]:
    return {
        "job_name": name,
        "kubernetes_sd_configs": [{"role": "endpoints", "namespaces": {"names": [namespace]}}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_service_name"], "regex": name, "action": "keep"},
            {"source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": "http", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }


def scrape_config(env: str, namespace: str, ports: Ports, datacenters: list[DatacenterTarget]) -> dict[str, Any]:
    jobs = [_service_job("gateway", namespace), _service_job("scheduler", namespace)]
    for dc in datacenters:
        jobs.append(_ec2_job(f"node-{dc.name}", env, dc, NODE_EXPORTER_PORT, None))
        for role in dc.pool_roles:
            port = ports.prefill if role is PoolRole.PREFILL else ports.decode
            jobs.append(_ec2_job(f"{role}-{dc.name}", env, dc, port, role))
    return {
        "global": {
            "scrape_interval": SCRAPE_INTERVAL,
            "evaluation_interval": SCRAPE_INTERVAL,
            "external_labels": {"environment": env},
        },
        "scrape_configs": jobs,
    }
