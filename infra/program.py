"""The program `pulumi up` runs for one stack: a datacenter's resources, or the control plane's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pulumi
import pulumi_aws as aws

from infra import environment, outputs
from infra.certificates import CertificateSpec, EnvironmentCertificates, EnvironmentCertificatesArgs
from infra.control_plane import ControlPlane, ControlPlaneArgs
from infra.dashboards import GrafanaDashboards, GrafanaDashboardsArgs
from infra.dns import PrivateZone, PrivateZoneArgs, ZoneMembership, ZoneMembershipArgs
from infra.encryption import ManagedKey, ManagedKeyArgs
from infra.environment import EnvironmentView
from infra.links import PRIVATE_ASN_BASE, LocalEnd, PeerLink, PeerLinkArgs, TransitHub, TransitHubArgs
from infra.network import Network, NetworkArgs
from infra.node_pool import GpuNodePool, GpuNodePoolArgs
from infra.pool_names import PoolRecords, PoolRecordsArgs
from infra.prometheus import DatacenterTarget, alertmanager_yaml, scrape_config
from infra.registry import ImageRegistry, ImageRegistryArgs
from infra.secrets import EnvironmentSecrets, EnvironmentSecretsArgs
from infra.security import NodeAccess, NodeSecurity, NodeSecurityArgs
from infra.storage import ModelStorage, ModelStorageArgs
from infra.tags import datacenter_tags, pool_tags
from infra.workloads import ControlWorkloads
from infra.workloads.access import ingress_host
from infra.workloads.common import GATEWAY_TOKEN, ControlWorkloadsArgs
from infra.workloads.ratelimit_store import RATELIMIT_STORE, RATELIMIT_STORE_CONFIG, ratelimit_store_config
from pdstack.contract.components import (
    Names,
    ca_certificate_parameter,
    cloud_names,
    cluster_service_name,
    contract,
    gateway_keys_file,
    prometheus_url_parameter,
    scheduler_url_parameter,
)
from pdstack.model import DatacenterRole, Environment, Serving
from pdstack.plan.catalog import Catalog, load_catalog

# The only secrets GPU nodes read: the KV channel key and the token their servers require of callers. Not the
# scheduler's identity key: whoever holds it can mint any principal's token, so each node gets only its own derived
# token from the deployer (roles/pdserve); the rest stay in the control plane.
NODE_SECRETS = ("kv-channel-key", "server-api-token")
API_KEYS = "gateway-api-keys"
RATELIMIT_PASSWORD = "ratelimit-store-password"  # noqa: S105 (a secret's name)
ALERT_RULES = Path(__file__).resolve().parents[1] / "monitoring" / "alerts.yml"
LOAD_BALANCED = ("gateway", "scheduler", "prometheus")  # the control plane's apps behind internal load balancers
IN_CLUSTER_TLS = (*LOAD_BALANCED, "alertmanager", RATELIMIT_STORE)  # each serves TLS from its own Secret
OPERATOR = "operator"  # the controller's client certificate (Secrets Manager), under mutual TLS


def main() -> None:
    view = environment.load()
    account_id = aws.get_caller_identity_output().account_id
    dc = view.this.datacenter
    tags = datacenter_tags(view.env, dc.name, str(dc.role))
    network = Network(
        dc.name,
        NetworkArgs(
            env=view.env,
            dc=dc.name,
            region=dc.region,
            cidr=dc.cidr,
            tags=tags,
            nat_per_zone=view.this.environment is not Environment.DEV,
            availability_zones=view.settings.availability_zones,
        ),
    )
    hub = TransitHub(
        dc.name,
        TransitHubArgs(
            asn=PRIVATE_ASN_BASE + sorted(view.datacenters).index(dc.name),
            vpc_id=network.vpc.id,
            attachment_subnet_ids=[s.id for s in network.transit_subnets],
            tags=tags,
        ),
    )
    volume_key = ManagedKey(
        f"{dc.name}-data",
        ManagedKeyArgs(
            description=f"pdstack {view.env} {dc.name}: volumes, model bucket, images",
            alias=f"pdstack-{view.env}-{dc.name}-data",
            account_id=account_id,
            tags=tags,
        ),
    )
    build_links(view, network, hub, tags)
    pulumi.export(outputs.REGION, dc.region)
    pulumi.export(outputs.ACCOUNT_ID, account_id)
    pulumi.export(outputs.CIDR, str(dc.cidr))
    pulumi.export(outputs.VPC_ID, network.vpc.id)
    pulumi.export(outputs.PRIVATE_ROUTE_TABLE_IDS, [t.id for t in network.private_route_tables])
    pulumi.export(outputs.TRANSIT_GATEWAY_ID, hub.gateway.id)
    pulumi.export(outputs.TRANSIT_GATEWAY_ROUTE_TABLE_ID, hub.route_table.id)
    pulumi.export(outputs.DATA_KEY_ARN, volume_key.key.arn)
    if dc.role is DatacenterRole.CONTROL:
        build_control_plane(view, network, volume_key, account_id, tags)
    else:
        build_datacenter(view, network, volume_key, account_id, tags)


def build_links(view: EnvironmentView, network: Network, hub: TransitHub, tags: dict[str, str]) -> None:
    dc = view.this.datacenter
    local = LocalEnd(
        region=dc.region,
        cidr=str(dc.cidr),
        vpc_id=network.vpc.id,
        route_table_ids=[t.id for t in network.private_route_tables],
        transit_gateway_id=hub.gateway.id,
        transit_gateway_route_table_id=hub.route_table.id,
    )
    for peer, link in view.links().items():
        if not view.builds_link_to(peer):
            continue  # the peer is deployed after us and builds this link
        peer_dc = view.datacenters[peer].datacenter
        PeerLink(
            f"link-{peer}",
            PeerLinkArgs(
                kind=link.kind,
                local=local,
                peer_stack=_qualified(view.stack_of(peer)),
                peer_region=peer_dc.region,
                peer_cidr=str(peer_dc.cidr),
                tags={**tags, "pdstack:peer": peer},
            ),
        )


def build_datacenter(
    view: EnvironmentView, network: Network, key: ManagedKey, account_id: pulumi.Output[str], tags: dict[str, str]
) -> None:
    dc = view.this.datacenter
    catalog = load_catalog()
    control = pulumi.StackReference("control", stack_name=_qualified(view.stack_of(view.control.datacenter.name)))
    storage = ModelStorage(
        dc.name,
        ModelStorageArgs(
            env=view.env,
            dc=dc.name,
            account_id=account_id,
            key_arn=key.key.arn,
            tags=tags,
            vpc_id=network.vpc.id,
            lustre_subnet_id=network.service_subnets[0].id,
            service_cidrs=[str(c) for c in network.plan.service],
            lustre_capacity_gib=view.settings.lustre_capacity_gib,
        ),
    )
    pulls_kv = view.linked_with_role(DatacenterRole.DECODE, DatacenterRole.MIXED)
    any_efa = any(p.efa and _has_efa(catalog, p.instance_type) for p in dc.pools)
    security = NodeSecurity(
        dc.name,
        NodeSecurityArgs(
            vpc_id=network.vpc.id,
            access=NodeAccess(
                pool_roles=frozenset(p.role for p in dc.pools),
                datacenter_role=dc.role,
                contract=contract(_serving(view)),
                own_cidr=str(dc.cidr),
                control_cidr=str(view.control.datacenter.cidr),
                kv_peer_cidrs=tuple(str(c.datacenter.cidr) for c in pulls_kv),
                management_cidrs=tuple(str(c) for c in network.plan.management),
                efa=any_efa,
            ),
            tags=tags,
        ),
    )
    zone_id = control.require_output(outputs.PRIVATE_ZONE_ID).apply(str)
    zone_name = control.require_output(outputs.PRIVATE_ZONE_NAME).apply(str)
    ZoneMembership(dc.name, ZoneMembershipArgs(zone_id=zone_id, vpc_id=network.vpc.id, region=dc.region))
    secret_arns = control.require_output(outputs.SECRET_ARNS)
    repositories = control.require_output(outputs.REPOSITORY_ARNS)
    tls_arns = control.require_output(outputs.TLS_SECRET_ARNS)
    groups = {}
    for pool in dc.pools:
        pool_group = GpuNodePool(
            f"{dc.name}-{pool.name}",
            GpuNodePoolArgs(
                pool=pool,
                efa=pool.efa and _has_efa(catalog, pool.instance_type),
                subnet_ids=[s.id for s in network.service_subnets],
                security_group_id=security.group.id,
                volume_key_arn=key.key.arn,
                readable_secret_arns=[
                    *(secret_arns.apply(_item(n)) for n in NODE_SECRETS),
                    tls_arns.apply(lambda arns, pool=pool.name: str(arns[dc.name][pool])),  # its own pool's only
                ],
                secrets_key_arn=control.require_output(outputs.ENV_KEY_ARN),
                secrets_region=view.control.datacenter.region,
                model_bucket_arn=storage.bucket.arn,
                repository_arns=[repositories.apply(_item(i)) for i in ("prefill", "decode")],
                instance_tags=pool_tags(view.env, dc.name, str(pool.role), pool.name),
                ssh_key_name=view.settings.ssh_key_name,
            ),
        )
        groups[pool.name] = pool_group.group.name
        PoolRecords(
            f"{dc.name}-{pool.name}",
            PoolRecordsArgs(
                record_name=zone_name.apply(lambda zone, pool=pool.name: Names(zone).host(pool, dc.name)),
                zone_id=zone_id,
                group_name=pool_group.group.name,
                tags=tags,
            ),
        )
    pulumi.export(outputs.MODEL_BUCKET, storage.bucket.bucket)
    pulumi.export(outputs.NODE_POOLS, groups)


def build_control_plane(
    view: EnvironmentView, network: Network, key: ManagedKey, account_id: pulumi.Output[str], tags: dict[str, str]
) -> None:
    cfg, dc = view.this, view.this.datacenter
    serving = cfg.serving
    assert serving is not None  # the model requires it on the control stack
    secrets = EnvironmentSecrets(
        "env",
        EnvironmentSecretsArgs(
            env=view.env,
            specs=cfg.secret_specs,
            account_id=account_id,
            tags=tags,
            recovery_window_days=7 if cfg.environment is Environment.DEV else 30,
        ),
    )
    registry = ImageRegistry("images", ImageRegistryArgs(env=view.env, key_arn=key.key.arn, tags=tags))
    names = cloud_names(view.env, view.settings.dns_domain)
    namespace = f"pdstack-{view.env}"
    certificates = EnvironmentCertificates(
        "tls",
        EnvironmentCertificatesArgs(
            env=view.env,
            components=[
                CertificateSpec(app, component_names(names, app, dc.name, namespace)) for app in IN_CLUSTER_TLS
            ],
            pools={
                c.datacenter.name: {
                    p.name: CertificateSpec(
                        f"{c.datacenter.name}-{p.name}",
                        [names.host(p.name, c.datacenter.name), names.instances(p.name, c.datacenter.name)],
                    )
                    for p in c.datacenter.pools
                }
                for c in view.datacenters.values()
                if c.datacenter.role is not DatacenterRole.CONTROL
            },
            # under mutual TLS the controller's calls (weights, the canary's checks) present their own
            operator=CertificateSpec(OPERATOR, [names.host(OPERATOR, dc.name)]) if _serving(view).mutual_tls else None,
            secrets_key_arn=secrets.key.key.arn,
            tags=tags,
            recovery_window_days=7 if cfg.environment is Environment.DEV else 30,
        ),
    )
    zone = PrivateZone("names", PrivateZoneArgs(zone=names.zone, vpc_id=network.vpc.id, region=dc.region, tags=tags))
    control_pool = dc.pools[0]
    plane = ControlPlane(
        "eks",
        ControlPlaneArgs(
            env=view.env,
            region=dc.region,
            kubernetes_version=view.settings.kubernetes_version,
            pool=control_pool,
            vpc_id=network.vpc.id,
            subnet_ids=[s.id for s in network.service_subnets],
            management_cidrs=[str(c) for c in network.plan.management],
            public_access_cidrs=view.settings.eks_public_access_cidrs,
            secrets_key_arn=secrets.key.key.arn,
            volume_key_arn=key.key.arn,
            namespace=namespace,
            tags=tags,
            node_tags=pool_tags(view.env, dc.name, str(control_pool.role), control_pool.name),
        ),
    )
    serving_dcs = [c.datacenter for c in view.datacenters.values() if c.datacenter.role is not DatacenterRole.CONTROL]
    images = {
        name: registry.repositories[name].repository_url.apply(lambda u: f"{u}:{view.settings.release}")
        for name in ("gateway", "scheduler")
    }
    replicas = 2 if cfg.environment is Environment.DEV else 3
    workloads = ControlWorkloads(
        "workloads",
        ControlWorkloadsArgs(
            env=view.env,
            namespace=namespace,
            images=images,
            contract=contract(serving),
            config_files={
                "serving.json": serving.model_dump_json(indent=2),
                "canary.json": cfg.canary.model_dump_json(indent=2) if cfg.canary else "{}",
                "datacenters.json": json.dumps(
                    {d.name: {"region": d.region, "cidr": str(d.cidr), "role": d.role} for d in serving_dcs}, indent=2
                ),
            },
            secret_values={
                **secrets.values,
                # the gateway reads a keys file holding the key's digest; clients use the key in Secrets Manager
                API_KEYS: secrets.values[API_KEYS].apply(lambda key: gateway_keys_file(key, view.env)),  # still secret
                GATEWAY_TOKEN: secrets.principal_token("gateway"),
                RATELIMIT_STORE_CONFIG: secrets.values[RATELIMIT_PASSWORD].apply(
                    lambda password: ratelimit_store_config(password, contract(serving).ratelimit_store.port)
                ),
            },
            client_cidrs=[str(c.datacenter.cidr) for c in view.datacenters.values()],
            datacenter_cidrs=[str(d.cidr) for d in serving_dcs],
            controller_cidrs=[str(c) for c in network.plan.management],
            cluster_cidr=str(dc.cidr),
            prometheus_config=scrape_config(
                view.env,
                namespace,
                contract(serving),
                [DatacenterTarget(d.name, d.region, tuple(sorted({p.role for p in d.pools}))) for d in serving_dcs],
                names.zone,
            ),
            alert_rules=ALERT_RULES.read_text(),
            alertmanager_config=alertmanager_yaml(view.env),
            volume_key_arn=key.key.arn,
            gateway_replicas=replicas,
            gateway_max_replicas=replicas * 4,
            load_balancer_certificates={app: certificates.load_balancer_certificate(app).arn for app in LOAD_BALANCED},
            dns_names={app: names.host(app, dc.name) for app in LOAD_BALANCED},
            tls={app: certificates.issued[app] for app in IN_CLUSTER_TLS},
        ),
        opts=pulumi.ResourceOptions(providers=[plane.provider]),
    )
    GrafanaDashboards(
        "dashboards",
        GrafanaDashboardsArgs(namespace=namespace),
        opts=pulumi.ResourceOptions(providers=[plane.provider], depends_on=[workloads]),
    )  # its namespace
    for app in LOAD_BALANCED:  # each load balancer's name in the environment's zone
        zone.alias(f"{app}-name", names.host(app, dc.name), workloads.services[app].status.apply(ingress_host))
    pulumi.export(outputs.PRIVATE_ZONE_ID, zone.zone.zone_id)
    pulumi.export(outputs.PRIVATE_ZONE_NAME, zone.zone.name)
    pulumi.export(outputs.TLS_SECRET_ARNS, certificates.pool_secret_arns)
    pulumi.export(outputs.CA_CERTIFICATE, certificates.ca_cert_pem)
    # What clients trust (the GPU nodes calling the scheduler, the controller's canary judge): public, not secret.
    aws.ssm.Parameter(
        "ca-certificate",
        name=ca_certificate_parameter(view.env),
        type="String",
        value=certificates.ca_cert_pem,
        description=f"pdstack {view.env}: the environment CA's certificate (PEM) every TLS listener chains to",
        tags=tags,
    )
    pulumi.export(outputs.ENV_KEY_ARN, secrets.key.key.arn)
    pulumi.export(outputs.SECRET_ARNS, secrets.arns)
    pulumi.export(outputs.SECRET_VALUES, pulumi.Output.secret(secrets.values))
    pulumi.export(outputs.REPOSITORY_ARNS, {k: r.arn for k, r in registry.repositories.items()})
    pulumi.export(outputs.REPOSITORY_URLS, {k: r.repository_url for k, r in registry.repositories.items()})
    pulumi.export(outputs.CLUSTER_NAME, plane.cluster.name)
    # The scheduler's URL, for the GPU nodes' deploy: in SSM Parameter Store, where inventories/aws reads it on the
    # controller (which needs no access to the Pulumi state), and as an output.
    aws.ssm.Parameter(
        "scheduler-url",
        name=scheduler_url_parameter(view.env),
        type="String",
        value=workloads.scheduler_url,
        description=f"pdstack {view.env}: the scheduler's load balancer URL (the GPU nodes' PDSERVE_SCHEDULER_URL)",
        tags=tags,
    )
    pulumi.export(outputs.SCHEDULER_URL, workloads.scheduler_url)
    # Prometheus' URL, for the controller's canary judge (deploy.yml), the same way.
    aws.ssm.Parameter(
        "prometheus-url",
        name=prometheus_url_parameter(view.env),
        type="String",
        value=workloads.prometheus_url,
        description=f"pdstack {view.env}: Prometheus' load balancer URL (the canary judge's --prometheus)",
        tags=tags,
    )
    pulumi.export(outputs.PROMETHEUS_URL, workloads.prometheus_url)


def component_names(names: Names, app: str, datacenter: str, namespace: str) -> list[str]:
    """What `app`'s certificate names: its name in the zone (an app behind a load balancer), then its in-cluster
    Service names."""
    zone = [names.host(app, datacenter)] if app in LOAD_BALANCED else []
    return [*zone, cluster_service_name(app, namespace), f"{app}.{namespace}.svc"]


def _serving(view: EnvironmentView) -> Serving:
    serving = view.control.serving
    assert serving is not None  # the model requires it on the control stack
    return serving


def _qualified(stack: str) -> str:
    return f"{pulumi.get_organization()}/{pulumi.get_project()}/{stack}"


def _has_efa(catalog: Catalog, instance_type: str) -> bool:
    inst = catalog.instance(instance_type)
    return inst is not None and inst.efa


def _item(key: str) -> Callable[[Any], str]:
    """`output.apply(_item(k))`: one entry of a mapping output, as a string."""
    return lambda values: str(values[key])
