"""The program `pulumi up` runs for one stack: a datacenter's resources, or the control plane's."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import pulumi_aws as aws
import yaml

from infra import environment, outputs
from infra.certificates import CertificateSpec, EnvironmentCertificates, EnvironmentCertificatesArgs
from infra.control_plane import ControlPlane, ControlPlaneArgs
from infra.dashboards import GrafanaDashboards, GrafanaDashboardsArgs
from infra.dns import PrivateZone, PrivateZoneArgs, ZoneMembership, ZoneMembershipArgs
from infra.encryption import ManagedKey, ManagedKeyArgs
from infra.environment import EnvironmentView
from infra.links import PRIVATE_ASN_BASE, LocalEnd, PeerLink, PeerLinkArgs, TransitHub, TransitHubArgs
from infra.network import Network, NetworkArgs
from infra.node_pool import GpuNodePool, GpuNodePoolArgs, parameter_arn
from infra.operator_access import OperatorAccess, OperatorAccessArgs
from infra.pool_names import PoolRecords, PoolRecordsArgs
from infra.prometheus import DatacenterTarget, alertmanager_yaml, scrape_config
from infra.registry import ImageRegistry, ImageRegistryArgs, node_images, repository_name
from infra.secrets import EnvironmentSecrets, EnvironmentSecretsArgs
from infra.security import NodeAccess, NodeSecurity, NodeSecurityArgs
from infra.storage import ModelStorage, ModelStorageArgs
from infra.tags import IMAGES as IMAGES_TAG
from infra.tags import datacenter_tags, pool_tags
from infra.workloads import ControlWorkloads
from infra.workloads.access import ingress_host
from infra.workloads.common import GATEWAY_TOKEN, ControlWorkloadsArgs
from infra.workloads.ratelimit_store import RATELIMIT_STORE, RATELIMIT_STORE_CONFIG, ratelimit_store_config
from pdstack.contract.alerting import plan_generation_tokens_per_second, rules_with_plan
from pdstack.contract.components import (
    GATEWAY_API_KEYS,
    RATELIMIT_PASSWORD,
    Contract,
    Names,
    ca_certificate_parameter,
    cloud_names,
    cluster_service_name,
    contract,
    gateway_keys_file,
    prometheus_url_parameter,
    release_parameter,
    scheduler_audience,
    scheduler_url_parameter,
    setting,
)
from pdstack.contract.node_lifecycle import drain_timeout_seconds, node_group_name, node_role_arn, node_role_name
from pdstack.contract.yamlfiles import dump_yaml
from pdstack.model import Datacenter, DatacenterRole, Environment, Serving, StackConfig
from pdstack.node.userdata import UserDataError, render_user_data
from pdstack.plan.catalog import Catalog, load_catalog

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
    serving_contract = contract(_serving(view))  # the environment's, from the control stack's serving block
    if dc.role is DatacenterRole.CONTROL:
        build_control_plane(view, network, volume_key, account_id, tags, serving_contract=serving_contract)
    else:
        build_datacenter(view, network, volume_key, account_id, tags, serving_contract=serving_contract)


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
    view: EnvironmentView,
    network: Network,
    key: ManagedKey,
    account_id: pulumi.Output[str],
    tags: dict[str, str],
    *,
    serving_contract: Contract,
) -> None:
    dc = view.this.datacenter
    catalog = load_catalog()
    control = pulumi.StackReference("control", stack_name=_qualified(view.stack_of(view.control.datacenter.name)))
    storage = model_storage(view, network, key, account_id, tags)
    security = node_security(view, network, tags, serving_contract, catalog)
    zone_id = control.require_output(outputs.PRIVATE_ZONE_ID).apply(str)
    zone_name = control.require_output(outputs.PRIVATE_ZONE_NAME).apply(str)
    ZoneMembership(dc.name, ZoneMembershipArgs(zone_id=zone_id, vpc_id=network.vpc.id, region=dc.region))
    secret_arns = control.require_output(outputs.SECRET_ARNS)
    repositories = control.require_output(outputs.REPOSITORY_ARNS)
    tls_arns = control.require_output(outputs.TLS_SECRET_ARNS)
    node_image = view.settings.node_image
    if node_image is None:
        raise environment.ConfigError(
            f"{environment.SETTINGS_NAMESPACE}:node_image: datacenter {dc.name} runs GPU pools; pin their image "
            "(an AMI id, or an SSM parameter naming one version, e.g. /aws/service/debian/release/12/<version>/amd64)"
        )
    control_region = view.control.datacenter.region
    release_arn = control.require_output(outputs.ACCOUNT_ID).apply(
        lambda account: parameter_arn(control_region, str(account), release_parameter(view.env))
    )
    # the scheduler's URL: a node reads it to join (its bootstrap's join phase) as its play does to heartbeat
    scheduler_url_arn = control.require_output(outputs.ACCOUNT_ID).apply(
        lambda account: parameter_arn(control_region, str(account), scheduler_url_parameter(view.env))
    )
    groups = {}
    for pool in dc.pools:
        images = node_images(_serving(view).engine, pool.role)
        pool_group = GpuNodePool(
            f"{dc.name}-{pool.name}",
            GpuNodePoolArgs(
                pool=pool,
                efa=pool.efa and _has_efa(catalog, pool.instance_type),
                subnet_ids=[s.id for s in network.service_subnets],
                security_group_id=security.group.id,
                volume_key_arn=key.key.arn,
                readable_secret_arns=[
                    *(secret_arns.apply(_item(n)) for n in serving_contract.node_secrets()),
                    tls_arns.apply(lambda arns, pool=pool.name: str(arns[dc.name][pool])),  # its own pool's only
                ],
                secrets_key_arn=control.require_output(outputs.ENV_KEY_ARN),
                secrets_region=view.control.datacenter.region,
                model_bucket_arn=storage.bucket.arn,
                # exactly the images this pool's nodes run (infra/registry.py), and its instances say which
                repository_arns=[repositories.apply(_item(i)) for i in images],
                release_parameter_arn=release_arn,
                scheduler_url_parameter_arn=scheduler_url_arn,
                account_id=account_id,
                group_name=node_group_name(view.env, dc.name, pool.name),
                role_name=node_role_name(view.env, dc.name, pool.name),
                region=dc.region,
                drain_timeout_seconds=drain_timeout_seconds(_serving(view)),
                instance_tags={
                    **pool_tags(view.env, dc.name, str(pool.role), pool.name),
                    IMAGES_TAG: " ".join(repository_name(view.env, i) for i in images),
                },
                node_image=node_image,
                user_data=pool_user_data(view, pool.name),
                capacity_wait_minutes=view.settings.capacity_wait_minutes,
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
    access = OperatorAccess(
        dc.name, OperatorAccessArgs(env=view.env, dc=dc.name, account_id=account_id, key_arn=key.key.arn, tags=tags)
    )
    pulumi.export(outputs.TRANSFER_BUCKET, access.bucket.bucket)
    pulumi.export(outputs.SESSION_DOCUMENT, access.document.name)


def pool_user_data(view: EnvironmentView, pool: str) -> str:
    """The pool's launch template user data: base64 of the `#cloud-config` pdstack/node/userdata.py renders for it
    from the stack files, the document the local environment's nodes of that pool boot with (docs/node-bootstrap.md)."""
    if view.settings.ssm_agent is None:
        pulumi.warn(
            f"pool {pool}: no SSM agent pinned (pdstack-infra:ssm_agent_version and ssm_agent_sha256, docs/cloud.md): "
            "its nodes install none, so no operator's session (amazon.aws.aws_ssm) reaches them"
        )
    try:
        text = render_user_data(view.this, view.control, pool, ssm_agent=view.settings.ssm_agent)
    except UserDataError as exc:
        raise environment.ConfigError(f"pool {pool}: {exc}") from None
    return base64.b64encode(text.encode()).decode()


def model_storage(
    view: EnvironmentView, network: Network, key: ManagedKey, account_id: pulumi.Output[str], tags: dict[str, str]
) -> ModelStorage:
    """The datacenter's model bucket and the Lustre file system its nodes load weights from."""
    dc = view.this.datacenter
    return ModelStorage(
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


def node_security(
    view: EnvironmentView, network: Network, tags: dict[str, str], serving_contract: Contract, catalog: Catalog
) -> NodeSecurity:
    """The GPU nodes' security group: the contract's ports, open to whom the datacenter's role and links say."""
    dc = view.this.datacenter
    pulls_kv = view.linked_with_role(DatacenterRole.DECODE, DatacenterRole.MIXED)
    return NodeSecurity(
        dc.name,
        NodeSecurityArgs(
            vpc_id=network.vpc.id,
            access=NodeAccess(
                pool_roles=frozenset(p.role for p in dc.pools),
                datacenter_role=dc.role,
                contract=serving_contract,
                own_cidr=str(dc.cidr),
                control_cidr=str(view.control.datacenter.cidr),
                kv_peer_cidrs=tuple(str(c.datacenter.cidr) for c in pulls_kv),
                efa=any(p.efa and _has_efa(catalog, p.instance_type) for p in dc.pools),
            ),
            tags=tags,
        ),
    )


@dataclass(frozen=True)
class ControlSite:
    """What every builder of the control plane shares: the stack, its network and key, and what the environment's
    serving block makes of it (the contract, computed once; the names in the zone; the Kubernetes namespace)."""

    view: EnvironmentView
    network: Network
    key: ManagedKey
    account_id: pulumi.Output[str]
    tags: dict[str, str]
    contract: Contract
    names: Names
    namespace: str

    @property
    def env(self) -> str:
        return self.view.env

    @property
    def dc(self) -> Datacenter:
        return self.view.this.datacenter

    @property
    def serving_dcs(self) -> list[Datacenter]:
        return [c.datacenter for c in self.view.datacenters.values() if c.datacenter.role is not DatacenterRole.CONTROL]

    @property
    def recovery_window_days(self) -> int:
        return 7 if self.view.this.environment is Environment.DEV else 30


def build_control_plane(
    view: EnvironmentView,
    network: Network,
    key: ManagedKey,
    account_id: pulumi.Output[str],
    tags: dict[str, str],
    *,
    serving_contract: Contract,
) -> None:
    site = ControlSite(
        view,
        network,
        key,
        account_id,
        tags,
        serving_contract,
        names=cloud_names(view.env, view.settings.dns_domain),
        namespace=f"pdstack-{view.env}",
    )
    secrets = environment_secrets(site)
    registry = ImageRegistry("images", ImageRegistryArgs(env=site.env, key_arn=key.key.arn, tags=tags))
    certificates = environment_certificates(site, secrets)
    zone = PrivateZone(
        "names", PrivateZoneArgs(zone=site.names.zone, vpc_id=network.vpc.id, region=site.dc.region, tags=tags)
    )
    plane = kubernetes_cluster(site, secrets)
    workloads = control_workloads(site, secrets, registry, certificates, plane)
    GrafanaDashboards(
        "dashboards",
        GrafanaDashboardsArgs(namespace=site.namespace),
        opts=pulumi.ResourceOptions(providers=[plane.provider], depends_on=[workloads]),
    )  # its namespace
    for app in LOAD_BALANCED:  # each load balancer's name in the environment's zone
        zone.alias(
            f"{app}-name", site.names.host(app, site.dc.name), workloads.services[app].status.apply(ingress_host)
        )
    export_control_plane(
        site, zone=zone, certificates=certificates, secrets=secrets, registry=registry, plane=plane, workloads=workloads
    )


def environment_secrets(site: ControlSite) -> EnvironmentSecrets:
    """The stack's secrets in Secrets Manager, under the environment's own key."""
    return EnvironmentSecrets(
        "env",
        EnvironmentSecretsArgs(
            env=site.env,
            specs=site.view.this.secret_specs,
            account_id=site.account_id,
            tags=site.tags,
            recovery_window_days=site.recovery_window_days,
        ),
    )


def environment_certificates(site: ControlSite, secrets: EnvironmentSecrets) -> EnvironmentCertificates:
    """The environment's CA and what it issues: each in-cluster app's certificate, each server pool's, and under
    mutual TLS the operator's (the controller's calls: weights, the canary's checks)."""
    names, dc = site.names, site.dc
    pools = {
        d.name: {
            p.name: CertificateSpec(f"{d.name}-{p.name}", [names.host(p.name, d.name), names.instances(p.name, d.name)])
            for p in d.pools
        }
        for d in site.serving_dcs
    }
    return EnvironmentCertificates(
        "tls",
        EnvironmentCertificatesArgs(
            env=site.env,
            components=[
                CertificateSpec(app, component_names(names, app, dc.name, site.namespace)) for app in IN_CLUSTER_TLS
            ],
            pools=pools,
            operator=CertificateSpec(OPERATOR, [names.host(OPERATOR, dc.name)]) if site.contract.mutual_tls else None,
            secrets_key_arn=secrets.key.key.arn,
            tags=site.tags,
            recovery_window_days=site.recovery_window_days,
        ),
    )


def kubernetes_cluster(site: ControlSite, secrets: EnvironmentSecrets) -> ControlPlane:
    """The EKS cluster the control plane's workloads run on, on the stack's one (control) pool."""
    dc, network = site.dc, site.network
    control_pool = dc.pools[0]
    settings = site.view.settings
    missing = [
        key
        for key, value in (
            ("eks_public_access_cidrs", settings.eks_public_access_cidrs),
            ("deploy_role_arn", settings.deploy_role_arn),
            ("plan_role_arn", settings.plan_role_arn),
        )
        if not value
    ]
    if missing or settings.deploy_role_arn is None or settings.plan_role_arn is None:
        raise environment.ConfigError(
            f"pdstack-infra:{', '.join(missing)}: required of a control stack: the pipeline reaches the EKS API from "
            "those CIDRs with those roles (docs/cloud.md, 'Reaching the cluster')"
        )
    return ControlPlane(
        "eks",
        ControlPlaneArgs(
            env=site.env,
            region=dc.region,
            kubernetes_version=site.view.settings.kubernetes_version,
            pool=control_pool,
            vpc_id=network.vpc.id,
            subnet_ids=[s.id for s in network.service_subnets],
            management_cidrs=[str(c) for c in network.plan.management],
            public_access_cidrs=settings.eks_public_access_cidrs,
            deploy_role_arn=settings.deploy_role_arn,
            plan_role_arn=settings.plan_role_arn,
            protect=settings.protect,
            secrets_key_arn=secrets.key.key.arn,
            volume_key_arn=site.key.key.arn,
            namespace=site.namespace,
            tags=site.tags,
            node_tags=pool_tags(site.env, dc.name, str(control_pool.role), control_pool.name),
        ),
    )


def control_workloads(
    site: ControlSite,
    secrets: EnvironmentSecrets,
    registry: ImageRegistry,
    certificates: EnvironmentCertificates,
    plane: ControlPlane,
) -> ControlWorkloads:
    """The gateway, scheduler, Prometheus, Alertmanager and rate-limit store on the cluster, as the contract says."""
    view, dc, names = site.view, site.dc, site.names
    images = {
        name: registry.repositories[name].repository_url.apply(lambda u: f"{u}:{view.settings.release}")
        for name in ("gateway", "scheduler")
    }
    replicas = 2 if view.this.environment is Environment.DEV else 3
    serving_dcs = site.serving_dcs
    return ControlWorkloads(
        "workloads",
        ControlWorkloadsArgs(
            env=site.env,
            namespace=site.namespace,
            images=images,
            contract=site.contract,
            config_files=config_files(site),
            secret_values=workload_secret_values(site, secrets),
            client_cidrs=[str(c.datacenter.cidr) for c in view.datacenters.values()],
            datacenter_cidrs=[str(d.cidr) for d in serving_dcs],
            controller_cidrs=[str(c) for c in site.network.plan.management],
            cluster_cidr=str(dc.cidr),
            prometheus_config=scrape_config(
                site.env,
                site.namespace,
                site.contract,
                [DatacenterTarget(d.name, d.region, tuple(sorted({p.role for p in d.pools}))) for d in serving_dcs],
                names.zone,
            ),
            alert_rules=alert_rules(view.control),
            alertmanager_config=alertmanager_yaml(site.env),
            volume_key_arn=site.key.key.arn,
            gateway_replicas=replicas,
            gateway_max_replicas=replicas * 4,
            load_balancer_certificates={app: certificates.load_balancer_certificate(app).arn for app in LOAD_BALANCED},
            dns_names={app: names.host(app, dc.name) for app in LOAD_BALANCED},
            tls={app: certificates.issued[app] for app in IN_CLUSTER_TLS},
            scheduler_join=scheduler_join_settings(site),
        ),
        opts=pulumi.ResourceOptions(providers=[plane.provider]),
    )


def alert_rules(control: StackConfig) -> str:
    """monitoring/alerts.yml with the plan's recording rule (pdstack:capacity), the one rules file the cloud's
    Prometheus loads; the rule group is empty without a capacity target."""
    planned = 0.0
    if (capacity := control.capacity) is not None:
        planned = plan_generation_tokens_per_second(capacity.requests_per_second, capacity.mean_output_tokens)
    return dump_yaml(rules_with_plan(yaml.safe_load(ALERT_RULES.read_text()), planned), width=120)


def scheduler_join_settings(site: ControlSite) -> dict[str, pulumi.Input[str]]:
    """How the GPU nodes join the scheduler by themselves (pdserve.scheduler.join): every serving pool's node role
    (its fixed name, pdstack.contract.node_lifecycle.node_role_name, in the environment's account: the datacenters'
    stacks run in it, as their nodes' access to the control plane's secrets and images assumes) -> the component its
    instances are named by; the environment's audience; STS in the control plane's region."""
    pools = [(d.name, p.name, str(p.role)) for d in site.serving_dcs for p in d.pools]
    roles = site.account_id.apply(
        lambda account: ",".join(
            f"{node_role_arn(str(account), site.env, dc, pool)}={role}" for dc, pool, role in pools
        )
    )
    if not pools:
        return {}
    return {
        setting("join_node_roles"): roles,
        setting("join_audience"): scheduler_audience(site.env),
        setting("join_region"): site.dc.region,
    }


def config_files(site: ControlSite) -> dict[str, str]:
    """The files the control plane's apps read beside their settings: the serving block, the canary's, and the
    serving datacenters."""
    canary = site.view.this.canary
    return {
        "serving.json": _serving(site.view).model_dump_json(indent=2),
        "canary.json": canary.model_dump_json(indent=2) if canary else "{}",
        "datacenters.json": json.dumps(
            {d.name: {"region": d.region, "cidr": str(d.cidr), "role": d.role} for d in site.serving_dcs}, indent=2
        ),
    }


def workload_secret_values(site: ControlSite, secrets: EnvironmentSecrets) -> dict[str, pulumi.Output[str]]:
    """The environment's Kubernetes Secret: the stack's secrets, with what the cloud's gateway reads in place of
    some (a keys file of digests, its derived scheduler token, the rate-limit store's configuration)."""
    api_keys, password = GATEWAY_API_KEYS.secret, RATELIMIT_PASSWORD.secret
    store_port = site.contract.ratelimit_store.port
    return {
        **secrets.values,
        # the gateway reads a keys file holding the key's digest; clients use the key in Secrets Manager
        api_keys: secrets.values[api_keys].apply(lambda key: gateway_keys_file(key, site.env)),  # still secret
        GATEWAY_TOKEN: secrets.principal_token("gateway"),
        RATELIMIT_STORE_CONFIG: secrets.values[password].apply(
            lambda password: ratelimit_store_config(password, store_port)
        ),
    }


def export_control_plane(
    site: ControlSite,
    *,
    zone: PrivateZone,
    certificates: EnvironmentCertificates,
    secrets: EnvironmentSecrets,
    registry: ImageRegistry,
    plane: ControlPlane,
    workloads: ControlWorkloads,
) -> None:
    """What the datacenter stacks and the controller read of the control plane: stack outputs, and in SSM Parameter
    Store what the controller needs without access to the Pulumi state."""
    env = site.env
    pulumi.export(outputs.PRIVATE_ZONE_ID, zone.zone.zone_id)
    pulumi.export(outputs.PRIVATE_ZONE_NAME, zone.zone.name)
    pulumi.export(outputs.TLS_SECRET_ARNS, certificates.pool_secret_arns)
    pulumi.export(outputs.CA_CERTIFICATE, certificates.ca_cert_pem)
    # What clients trust (the GPU nodes calling the scheduler, the controller's canary judge): public, not secret.
    publish_parameter(
        site,
        "ca-certificate",
        ca_certificate_parameter(env),
        certificates.ca_cert_pem,
        f"pdstack {env}: the environment CA's certificate (PEM) every TLS listener chains to",
    )
    pulumi.export(outputs.ENV_KEY_ARN, secrets.key.key.arn)
    pulumi.export(outputs.SECRET_ARNS, secrets.arns)
    pulumi.export(outputs.REPOSITORY_ARNS, {k: r.arn for k, r in registry.repositories.items()})
    pulumi.export(outputs.REPOSITORY_URLS, {k: r.repository_url for k, r in registry.repositories.items()})
    pulumi.export(outputs.CLUSTER_NAME, plane.cluster.name)
    # The scheduler's URL, for the GPU nodes' deploy: in SSM Parameter Store, where inventories/aws reads it on the
    # controller (which needs no access to the Pulumi state), and as an output.
    publish_parameter(
        site,
        "scheduler-url",
        scheduler_url_parameter(env),
        workloads.scheduler_url,
        f"pdstack {env}: the scheduler's load balancer URL (the GPU nodes' PDSERVE_SCHEDULER_URL)",
    )
    pulumi.export(outputs.SCHEDULER_URL, workloads.scheduler_url)
    # Prometheus' URL, for the controller's canary judge (deploy.yml), the same way.
    publish_parameter(
        site,
        "prometheus-url",
        prometheus_url_parameter(env),
        workloads.prometheus_url,
        f"pdstack {env}: Prometheus' load balancer URL (the canary judge's --prometheus)",
    )
    pulumi.export(outputs.PROMETHEUS_URL, workloads.prometheus_url)


def publish_parameter(
    site: ControlSite, resource: str, name: str, value: pulumi.Input[str], description: str
) -> aws.ssm.Parameter:
    """A plain (public) SSM parameter of the environment."""
    return aws.ssm.Parameter(resource, name=name, type="String", value=value, description=description, tags=site.tags)


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
