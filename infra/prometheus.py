"""Prometheus's configuration in the cloud: the control-plane pods through their headless Services' DNS, and every
datacenter's nodes through EC2 discovery keyed on the pdstack tags (so new Auto Scaling instances appear alone).

Job names, ports and paths are the deployment contract's (pdstack/contract/components.py), the same as the local
Prometheus (roles/prometheus): one job per component (`pdserve-gateway`, `pdserve-prefill`, ...), `node` for
node_exporter, `prometheus` for itself; datacenter, role, pool and zone are labels. So monitoring/alerts.yml, which it
loads, selects the same jobs in both places. Alerts go to the Alertmanager beside it (infra/workloads/monitoring.py),
configured as the local one is (pdstack/contract/alerting.py). A job whose targets require a token (the gateway's
/metrics) presents the contract's credentials file, which the Prometheus pod mounts from the environment's Secret.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pulumi
import yaml

from infra.tags import DC, ENV, POOL, ROLE
from pdstack.contract.alerting import alertmanager_config
from pdstack.contract.components import (
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_DIR,
    TLS_KEY_FILE,
    Component,
    Contract,
    cluster_service_name,
)
from pdstack.model import PoolRole
from pdstack.stacks.files import NAMESPACE

SCRAPE_INTERVAL = "15s"
RULES_FILE = "alerts.yml"  # beside prometheus.yml in the same ConfigMap: rule_files resolve relative to it
WEB_CONFIG_FILE = "web.yml"  # beside it too: Prometheus' own listener (TLS)


@dataclass(frozen=True)
class DatacenterTarget:
    name: str
    region: str
    pool_roles: tuple[PoolRole, ...]


def _tag_label(tag: str) -> str:
    return "__meta_ec2_tag_" + tag.replace(":", "_")


EC2_RELABEL = [
    {"source_labels": [_tag_label(DC)], "target_label": "datacenter"},
    {"source_labels": [_tag_label(ROLE)], "target_label": "role"},
    {"source_labels": [_tag_label(POOL)], "target_label": "pool"},
    {"source_labels": ["__meta_ec2_instance_id"], "target_label": "instance_id"},
    {"source_labels": ["__meta_ec2_availability_zone"], "target_label": "zone"},
]


def _ec2_sd(env: str, dc: DatacenterTarget, port: int, role: PoolRole | None) -> dict[str, Any]:
    filters = [
        {"name": f"tag:{ENV}", "values": [env]},
        {"name": f"tag:{DC}", "values": [dc.name]},
        {"name": "instance-state-name", "values": ["running"]},
    ]
    if role is not None:
        filters.append({"name": f"tag:{ROLE}", "values": [str(role)]})
    return {"region": dc.region, "port": port, "filters": filters}


def instance_address(zone: str, port: int) -> dict[str, Any]:
    """Scrape an instance by its own name, <instance id>.<pool>.<datacenter>.<zone> (pdstack.contract.components
    Names.instance, the record infra/lambdas/pool_records.py keeps), which its pool's certificate carries."""
    return {
        "source_labels": ["__meta_ec2_instance_id", _tag_label(POOL), _tag_label(DC)],
        "separator": ".",
        "regex": "(.+)",
        "target_label": "__address__",
        "replacement": f"${{1}}.{zone}:{port}",
    }


def _ec2_job(job: str, sd_configs: list[dict[str, Any]], zone: str, metrics_path: str | None = None) -> dict[str, Any]:
    port = sd_configs[0]["port"]
    return {
        "job_name": job,
        **({"metrics_path": metrics_path} if metrics_path else {}),
        "scheme": "https",
        "tls_config": tls_client(),
        "ec2_sd_configs": sd_configs,
        "relabel_configs": [*EC2_RELABEL, instance_address(zone, port)],
    }


def authorization(contract: Contract, job: str) -> dict[str, str] | None:
    """The contract's `authorization` block of a job whose targets require a token (the gateway's /metrics), which
    Prometheus reads from the file its pod mounts at the same path (infra/workloads/monitoring.py)."""
    return next((g.authorization() for g in contract.scrape_groups if g.job == job), None)


def tls_client(server_name: str | None = None) -> dict[str, Any]:
    """How Prometheus scrapes a TLS listener: the environment's CA, the name the target's certificate carries where
    it is dialled by another (a pod by address), and its own certificate, which a listener under mutual TLS asks
    for."""
    return {
        "ca_file": f"{TLS_DIR}/{TLS_CA_FILE}",
        **({"server_name": server_name} if server_name else {}),
        "cert_file": f"{TLS_DIR}/{TLS_CERT_FILE}",
        "key_file": f"{TLS_DIR}/{TLS_KEY_FILE}",
    }


def web_config(client_auth: bool = False) -> dict[str, Any]:
    """A Prometheus-family listener (--web.config.file): TLS with its certificate, which it re-reads as it changes;
    with `client_auth`, only for callers presenting a certificate from the environment's CA."""
    server = {
        "cert_file": f"{TLS_DIR}/{TLS_CERT_FILE}",
        "key_file": f"{TLS_DIR}/{TLS_KEY_FILE}",
        "min_version": "TLS12",
    }
    if client_auth:
        server |= {"client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": f"{TLS_DIR}/{TLS_CA_FILE}"}
    return {"tls_server_config": server}


def pods_service(service: str) -> str:
    """The headless Service naming every pod of a control-plane Deployment (infra/workloads/pdserve_apps.py)."""
    return f"{service}-pods"


def _service_job(job: str, service: str, namespace: str, port: int, metrics_path: str) -> dict[str, Any]:
    """Every pod of the Deployment, through its headless Service's DNS records (not Kubernetes discovery: no API
    access for Prometheus, and Debian's promtool, which the tests check the config with, has no Kubernetes SD)."""
    return {
        "job_name": job,
        "metrics_path": metrics_path,
        "scheme": "https",
        "tls_config": tls_client(cluster_service_name(service, namespace)),
        "dns_sd_configs": [
            {"names": [cluster_service_name(pods_service(service), namespace)], "type": "A", "port": port}
        ],
        "relabel_configs": [{"target_label": "role", "replacement": "control"}],
    }


def alertmanager_address(namespace: str, contract: Contract) -> str:
    return f"alertmanager.{namespace}.svc:{contract.alertmanager.port}"


def scrape_config(
    env: str, namespace: str, contract: Contract, datacenters: list[DatacenterTarget], zone: str
) -> dict[str, Any]:
    itself = {"targets": [f"localhost:{contract.prometheus.port}"]}
    jobs: list[dict[str, Any]] = [
        {
            "job_name": contract.prometheus.job,
            "scheme": "https",
            "tls_config": tls_client(cluster_service_name("prometheus", namespace)),
            "static_configs": [itself],
        }
    ]
    for component in (Component.SCHEDULER, Component.GATEWAY):
        served = contract[component]
        jobs.append(_service_job(served.job, str(component), namespace, served.port, served.metrics_path))
    for component, role in ((Component.PREFILL, PoolRole.PREFILL), (Component.DECODE, PoolRole.DECODE)):
        served = contract[component]
        sd = [_ec2_sd(env, dc, served.port, role) for dc in datacenters if role in dc.pool_roles]
        if sd:
            jobs.append(_ec2_job(served.job, sd, zone, served.metrics_path))
    node_job = contract.node_exporter.job
    assert node_job is not None
    jobs.append(_ec2_job(node_job, [_ec2_sd(env, dc, contract.node_exporter.port, None) for dc in datacenters], zone))
    for job in jobs:  # the contract's credential where its targets require one (the gateway's /metrics)
        credential = authorization(contract, job["job_name"])
        if credential is not None:
            job["authorization"] = credential
    return {
        "global": {
            "scrape_interval": SCRAPE_INTERVAL,
            "evaluation_interval": SCRAPE_INTERVAL,
            "external_labels": {"environment": env},
        },
        "rule_files": [RULES_FILE],
        "alerting": {
            "alertmanagers": [
                {
                    "scheme": "https",
                    "tls_config": tls_client(cluster_service_name("alertmanager", namespace)),
                    "static_configs": [{"targets": [alertmanager_address(namespace, contract)]}],
                }
            ]
        },
        "scrape_configs": jobs,
    }


ALERTING_KEY = "alerting"  # pdstack:alerting (pdstack.model.Alerting), read as a secret: its URL may hold a token
# What an offline run (pdstack synth, Pulumi mocks) renders for a webhook URL it holds only as ciphertext.
UNDECRYPTED_WEBHOOK = "https://pulumi-secret.invalid/webhook"


def webhook_url(alerting: object) -> str | None:
    """The webhook URL in the stack's `pdstack:alerting` as `pulumi up` hands it over (decrypted); None without
    one. Still `{secure: ...}` only where Pulumi cannot decrypt (under mocks)."""
    url: object = cast("dict[str, object]", alerting).get("webhook_url") if isinstance(alerting, dict) else None
    if isinstance(url, dict):
        return UNDECRYPTED_WEBHOOK
    return url if isinstance(url, str) else None


def stack_alerting() -> pulumi.Output[Any]:
    """This (control-plane) stack's `pdstack:alerting`, decrypted by Pulumi, as a secret Output (None if unset)."""
    found = pulumi.Config(NAMESPACE).get_secret_object(ALERTING_KEY)
    return found if found is not None else pulumi.Output.secret(None)


def alertmanager_yaml(env: str, alerting: pulumi.Output[Any] | None = None) -> pulumi.Output[str]:
    """The environment's alertmanager.yml (pdstack/contract/alerting.py: routes by severity, link-down inhibition, the
    stack's webhook), as a secret Output: the URL it holds may carry a token."""
    source = alerting if alerting is not None else stack_alerting()
    rendered = source.apply(lambda value: yaml_text(alertmanager_config(env, webhook_url(value))))
    return pulumi.Output.secret(rendered)


def yaml_text(config: dict[str, Any]) -> str:
    text: str = yaml.safe_dump(config, sort_keys=False)  # pyright: ignore[reportUnknownMemberType]  # partly untyped stub
    return text
