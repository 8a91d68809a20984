"""The Pulumi program's resource graph for every example cloud stack, built under mocks, has the properties the
design promises: no open ingress, KV only to peers, encryption, IMDSv2, EFA in cluster placement, tags, probes,
secrets kept secret, links built both ways by the later stack."""

from __future__ import annotations

import json
from ipaddress import ip_network

import pytest
import yaml

from infra import outputs
from infra.workloads.common import SECRET_NAME
from pdserve.scheduler import identity
from pdstack.contract.alerting import PLAN_GROUP, PLAN_RECORD
from pdstack.model import REQUIRED_SECRETS, DatacenterRole
from pdstack.synth.synthesis import SynthError, Synthesis, synthesize
from tests.support import REPO, STACKS

from .conftest import CLOUD_STACKS, stack_config

INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE_TAGS = {"pdstack:env", "pdstack:dc", "pdstack:role", "pdstack:pool"}


def test_the_examples_cover_every_cloud_environment_and_role() -> None:
    assert len(CLOUD_STACKS) == 9
    assert {n.split("-")[0] for n in CLOUD_STACKS} == {"dev", "staging", "prod"}


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_every_example_stack_synthesises_without_policy_violations(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    assert graph.resources, name
    assert graph.violations == []


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_no_ingress_from_the_internet(graphs: dict[str, Synthesis], name: str) -> None:
    rules = graphs[name].of_type(INGRESS)
    assert rules
    for rule in rules:
        cidr = rule.inputs.get("cidrIpv4")
        assert cidr is None or ip_network(cidr).prefixlen >= 16, (rule.name, cidr)
        assert "cidrIpv6" not in rule.inputs
    for group in graphs[name].of_type("aws:ec2/securityGroup:SecurityGroup"):
        assert not group.inputs.get("ingress"), "ingress is declared rule by rule, never inline"


def _kv_rules(graph: Synthesis, kv_port: int) -> list:
    return [
        r
        for r in graph.of_type(INGRESS)
        if (r.inputs.get("ipProtocol") == "-1" and "cidrIpv4" in r.inputs)
        or r.inputs.get("fromPort", -1) <= kv_port <= r.inputs.get("toPort", -1)
    ]


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_kv_port_opens_only_to_linked_decode_peers(graphs: dict[str, Synthesis], name: str) -> None:
    cfg = stack_config(name)
    env = {n.split("-", 1)[1]: stack_config(n) for n in CLOUD_STACKS if n.startswith(f"{cfg.environment}-")}
    control = next(c for c in env.values() if c.serving is not None)
    kv_port = control.serving.ports.kv
    linked = {link.peer for link in cfg.datacenter.links} | {
        other.datacenter.name
        for other in env.values()
        for link in other.datacenter.links
        if link.peer == cfg.datacenter.name
    }
    expected = set()
    if cfg.datacenter.role is DatacenterRole.PREFILL:
        expected = {str(env[p].datacenter.cidr) for p in linked if env[p].datacenter.role is DatacenterRole.DECODE}
        assert expected, "each example prefill datacenter has a decode peer"
    rules = _kv_rules(graphs[name], kv_port)
    assert {r.inputs["cidrIpv4"] for r in rules} == expected
    assert all(r.inputs["tags"]["pdstack:purpose"] == "kv" for r in rules)


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_serving_opens_only_to_control_and_the_kube_api_to_management(graphs: dict[str, Synthesis], name: str) -> None:
    cfg = stack_config(name)
    control_cidr = next(str(stack_config(n).datacenter.cidr) for n in CLOUD_STACKS if n == f"{cfg.environment}-control")
    management = {
        r.inputs["cidrBlock"]
        for r in graphs[name].of_type("aws:ec2/subnet:Subnet")
        if r.inputs["tags"]["pdstack:tier"] == "management"
    }
    for rule in graphs[name].of_type(INGRESS):
        purpose = rule.inputs["tags"]["pdstack:purpose"]
        if purpose.startswith("serving") or purpose == "metrics":
            assert rule.inputs["cidrIpv4"] == control_cidr
        if purpose == "kube-api":
            assert rule.inputs["cidrIpv4"] in management


def _opens_ssh(graph: Synthesis) -> list[str]:
    return [
        r.name
        for r in graph.of_type(INGRESS)
        if (r.inputs.get("ipProtocol") == "-1" and "cidrIpv4" in r.inputs)
        or r.inputs.get("fromPort", 0) <= 22 <= r.inputs.get("toPort", -1)
    ]


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_no_network_may_reach_a_nodes_ssh(graphs: dict[str, Synthesis], name: str) -> None:
    """Operators come in through SSM sessions, which the node's agent opens outwards: port 22 opens to no CIDR."""
    assert _opens_ssh(graphs[name]) == []


def test_not_even_with_the_optional_key_pair() -> None:
    """SSH with pdstack-infra:ssh_key_name runs inside a session (AWS-StartSSHSession, to the node's own sshd)."""
    graph = synthesize(STACKS / "Pulumi.dev-decode-us-east-2.yaml", {"pdstack-infra:ssh_key_name": "operators"})
    assert {t.inputs["keyName"] for t in graph.of_type(LAUNCH_TEMPLATE)} == {"operators"}
    assert _opens_ssh(graph) == []


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_everything_at_rest_is_encrypted_with_customer_keys(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    templates = graph.of_type(LAUNCH_TEMPLATE)
    assert templates
    for template in templates:
        for mapping in template.inputs["blockDeviceMappings"]:
            assert mapping["ebs"]["encrypted"] == "true"
            assert mapping["ebs"]["kmsKeyId"]
    for key in graph.of_type("aws:kms/key:Key"):
        assert key.inputs["enableKeyRotation"] is True
    for secret in graph.of_type("aws:secretsmanager/secret:Secret"):
        assert secret.inputs["kmsKeyId"]
    for sse in graph.of_type("aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"):
        assert sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "aws:kms"
    buckets = graph.of_type("aws:s3/bucket:Bucket")
    blocks = graph.of_type("aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock")
    assert len(blocks) == len(buckets)
    for cluster in graph.of_type("aws:eks/cluster:Cluster"):
        assert cluster.inputs["encryptionConfig"]["resources"] == ["secrets"]


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_instances_require_imdsv2_and_carry_the_inventory_tags(graphs: dict[str, Synthesis], name: str) -> None:
    for template in graphs[name].of_type(LAUNCH_TEMPLATE):
        assert template.inputs["metadataOptions"]["httpTokens"] == "required"
        instance = next(s for s in template.inputs["tagSpecifications"] if s["resourceType"] == "instance")
        assert set(instance["tags"]) >= INSTANCE_TAGS
        assert instance["tags"]["pdstack:dc"] == stack_config(name).datacenter.name
    for group in graphs[name].of_type("aws:autoscaling/group:Group"):
        propagated = {t["key"] for t in group.inputs["tags"] if t["propagateAtLaunch"]}
        assert propagated >= INSTANCE_TAGS


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_efa_pools_sit_in_one_zone_in_a_cluster_placement_group(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    strategies = {g.name: g.inputs["strategy"] for g in graph.of_type("aws:ec2/placementGroup:PlacementGroup")}
    pools = {p.name: p for p in stack_config(name).datacenter.pools}
    for template in graph.of_type(LAUNCH_TEMPLATE):
        kinds = [i.get("interfaceType") for i in template.inputs.get("networkInterfaces", [])]
        pool = next((p for n, p in pools.items() if template.name.endswith(f"-{n}-template")), None)
        if pool is None:
            continue  # the EKS node group's template
        assert bool(pool.efa) == ("efa" in kinds)
        if pool.efa:
            assert strategies[template.inputs["placement"]["groupName"]] == "cluster"
            group = next(g for g in graph.of_type("aws:autoscaling/group:Group") if g.parent == template.parent)
            assert len(group.inputs["vpcZoneIdentifiers"]) == 1


def test_p5_pools_get_one_efa_interface_per_network_card(graphs: dict[str, Synthesis]) -> None:
    template = next(t for t in graphs["prod-prefill-us-east-1"].of_type(LAUNCH_TEMPLATE))
    interfaces = template.inputs["networkInterfaces"]
    assert len(interfaces) == 32
    assert interfaces[0]["interfaceType"] == "efa" and interfaces[0]["deviceIndex"] == 0
    assert {i["interfaceType"] for i in interfaces[1:]} == {"efa-only"}
    assert sorted(i["networkCardIndex"] for i in interfaces) == list(range(32))


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_asg_sizes_come_from_the_stack(graphs: dict[str, Synthesis], name: str) -> None:
    cfg = stack_config(name)
    groups = graphs[name].of_type("aws:autoscaling/group:Group")
    if cfg.datacenter.role is DatacenterRole.CONTROL:
        assert groups == []
        return
    sizes = sorted((g.inputs["minSize"], g.inputs["desiredCapacity"], g.inputs["maxSize"]) for g in groups)
    assert sizes == sorted((p.min_size, p.desired_size, p.max_size) for p in cfg.datacenter.pools)


def _generated(graph: Synthesis) -> dict[str, str]:
    """Each generated secret's value (its SecretVersion's secretString), by the secret's name; TLS pairs aside."""
    names = {
        s.name: s.inputs["name"].rsplit("/", 1)[1]
        for s in graph.of_type("aws:secretsmanager/secret:Secret")
        if "/tls/" not in s.inputs["name"]
    }
    return {
        names[v.name]: v.inputs["secretString"]
        for v in graph.of_type("aws:secretsmanager/secretVersion:SecretVersion")
        if v.name in names
    }


def _generated_values(graph: Synthesis) -> set[str]:
    return set(_generated(graph).values())


@pytest.mark.parametrize("name", [n for n in CLOUD_STACKS if n.endswith("-control")])
def test_generated_secrets_stay_secret(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    values = _generated_values(graph)
    assert len(values) == len(REQUIRED_SECRETS)
    assert graph.secret_outputs == set()  # no output holds a secret (policy no-secret-outputs)
    stored = [s.inputs["name"] for s in graph.of_type("aws:secretsmanager/secret:Secret")]
    assert {s.rsplit("/", 1)[1] for s in stored if "/tls/" not in s} == set(REQUIRED_SECRETS)
    for version in graph.of_type("aws:secretsmanager/secretVersion:SecretVersion"):
        assert "secretString" in version.secret_inputs
    k8s_secret = next(
        s for s in graph.of_type("kubernetes:core/v1:Secret") if s.inputs["metadata"]["name"] == SECRET_NAME
    )  # not alertmanager's
    assert "stringData" in k8s_secret.secret_inputs
    # The gateway's scheduler token is derived from the identity key (contract §1), secret like the key itself.
    key = _generated(graph)["scheduler-identity-key"]
    assert k8s_secret.inputs["stringData"]["scheduler-gateway-token"] == identity.derive_token(key, "gateway")
    values.add(k8s_secret.inputs["stringData"]["scheduler-gateway-token"])
    # No generated value appears anywhere it is not marked secret.
    for resource in graph.resources:
        plain = {k: v for k, v in resource.inputs.items() if k not in resource.secret_inputs}
        assert not any(v in repr(plain) for v in values), resource.name
    plain_outputs = {k: v for k, v in graph.outputs.items() if k not in graph.secret_outputs}
    assert not any(v in repr(plain_outputs) for v in values)


def test_control_workloads_read_the_hardened_credentials_as_files(graphs: dict[str, Synthesis]) -> None:
    deployments = {
        d.inputs["metadata"]["name"]: d for d in graphs["prod-control"].of_type("kubernetes:apps/v1:Deployment")
    }

    def mounted(app: str) -> dict[str, str]:
        """secret key -> file under /run/secrets"""
        volumes = deployments[app].inputs["spec"]["template"]["spec"]["volumes"]
        secret = next(v["secret"] for v in volumes if "secret" in v)
        assert secret["optional"] is False
        return {item["key"]: item["path"] for item in secret["items"]}

    env = deployments["gateway"].inputs["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not any("valueFrom" in e for e in env)  # no secret value in an environment variable
    assert mounted("scheduler") == {"scheduler-admin-token": "admin.token", "scheduler-identity-key": "identity.key"}
    assert mounted("gateway") == {
        "gateway-api-keys": "api-keys.json",
        "scheduler-gateway-token": "scheduler.token",
        "server-api-token": "server.token",
        "ratelimit-store-password": "ratelimit.password",
        "metrics-scrape-token": "metrics.token",
    }
    assert mounted("ratelimit") == {"ratelimit-store-redis.conf": "redis.conf"}  # requirepass: a file, not an arg


def test_each_link_is_built_once_by_its_later_end_with_routes_both_ways(graphs: dict[str, Synthesis]) -> None:
    def links(name: str) -> set[str]:
        return {r.name for r in graphs[name].of_type("pdstack:links:PeerLink")}

    assert links("prod-control") == set()  # deployed first: the others reach back to it
    assert links("prod-prefill-us-east-1") == {"link-control"}
    assert links("prod-decode-us-west-2") == {"link-control", "link-prefill-us-east-1"}
    decode = graphs["prod-decode-us-west-2"]
    assert len(decode.of_type("aws:ec2transitgateway/peeringAttachment:PeeringAttachment")) == 2
    accepters = decode.of_type("aws:ec2transitgateway/peeringAttachmentAccepter:PeeringAttachmentAccepter")
    assert {a.inputs["region"] for a in accepters} == {"us-east-1"}
    routes = {
        (r.name, r.inputs["destinationCidrBlock"], r.inputs.get("region"))
        for r in decode.of_type("aws:ec2/route:Route")
        if r.name.startswith("link-prefill")
    }
    assert routes == {
        ("link-prefill-us-east-1-out-0", "10.31.0.0/16", None),
        ("link-prefill-us-east-1-out-1", "10.31.0.0/16", None),
        ("link-prefill-us-east-1-back-0", "10.32.0.0/16", "us-east-1"),
        ("link-prefill-us-east-1-back-1", "10.32.0.0/16", "us-east-1"),
    }
    tgw_routes = {
        (r.inputs["destinationCidrBlock"], r.inputs.get("region"))
        for r in decode.of_type("aws:ec2transitgateway/route:Route")
        if r.name.startswith("link-prefill")
    }
    assert tgw_routes == {("10.31.0.0/16", None), ("10.32.0.0/16", "us-east-1")}
    prefill = graphs["prod-prefill-us-east-1"]
    assert len(prefill.of_type("aws:ec2/vpcPeeringConnection:VpcPeeringConnection")) == 1  # kind vpc_peering


def test_peers_are_found_through_stack_references_by_stack_name(graphs: dict[str, Synthesis]) -> None:
    refs = {r.inputs["name"] for r in graphs["prod-decode-us-west-2"].of_type("pulumi:pulumi:StackReference")}
    assert refs == {"organization/pdstack/prod-control", "organization/pdstack/prod-prefill-us-east-1"}


def test_exports_cover_what_stack_references_read(graphs: dict[str, Synthesis]) -> None:
    for name, graph in graphs.items():
        assert set(outputs.PEER_NETWORK) <= set(graph.outputs), name
        if name.endswith("-control"):
            assert set(outputs.CONTROL_FOR_DATACENTERS) <= set(graph.outputs)
            assert set(graph.outputs[outputs.SECRET_ARNS]) >= {"kv-channel-key"}
            assert set(graph.outputs[outputs.REPOSITORY_ARNS]) >= {"prefill", "decode"}


def test_nodes_may_read_only_the_kv_key_and_server_token(graphs: dict[str, Synthesis]) -> None:
    # the decode-h200 pool's node policy by name: the stack has two pools, registered in no fixed order
    policy = next(
        p
        for p in graphs["prod-decode-us-west-2"].of_type("aws:iam/rolePolicy:RolePolicy")
        if p.name == "decode-us-west-2-decode-h200-node"
    )
    statements = {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}
    assert statements["ReadNodeSecrets"]["Resource"] == [
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:pdstack/prod/kv-channel-key-AbCdEf",
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:pdstack/prod/server-api-token-AbCdEf",
        # its own pool's certificate and key (infra/certificates.py), no other pool's
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:pdstack/prod/tls/decode-us-west-2/decode-h200-AbCdEf",
    ]  # never the scheduler's identity key: a node holding it could mint any instance's token
    assert [r.rsplit("/", 2)[-2] for r in statements["ReadReleaseObjects"]["Resource"]] == ["models", "bundles"]


def test_prometheus_scrapes_every_datacenters_nodes(graphs: dict[str, Synthesis]) -> None:
    config_map = next(
        c
        for c in graphs["prod-control"].of_type("kubernetes:core/v1:ConfigMap")
        if c.inputs["metadata"]["name"] == "prometheus"
    )
    jobs = {j["job_name"]: j for j in yaml.safe_load(config_map.inputs["data"]["prometheus.yml"])["scrape_configs"]}
    assert {"node", "pdserve-prefill", "pdserve-decode", "pdserve-gateway", "pdserve-scheduler"} <= set(jobs)
    assert {sd["region"] for sd in jobs["node"]["ec2_sd_configs"]} == {"us-east-1", "us-west-2"}
    sd = jobs["pdserve-decode"]["ec2_sd_configs"][0]
    assert sd["region"] == "us-west-2" and sd["port"] == 8300
    assert {"name": "tag:pdstack:dc", "values": ["decode-us-west-2"]} in sd["filters"]


def test_the_cloud_prometheus_loads_the_alert_rules_and_the_plans_recording_rule(graphs: dict[str, Synthesis]) -> None:
    config_map = next(
        c
        for c in graphs["prod-control"].of_type("kubernetes:core/v1:ConfigMap")
        if c.inputs["metadata"]["name"] == "prometheus"
    )
    loaded = yaml.safe_load(config_map.inputs["data"]["alerts.yml"])
    alerts = yaml.safe_load((REPO / "monitoring" / "alerts.yml").read_text())
    assert [g for g in loaded["groups"] if g["name"] != PLAN_GROUP] == alerts["groups"]
    capacity = stack_config("prod-control").capacity
    assert capacity is not None
    [plan] = [g for g in loaded["groups"] if g["name"] == PLAN_GROUP]
    planned = capacity.requests_per_second * capacity.mean_output_tokens
    assert plan["rules"] == [{"record": PLAN_RECORD, "expr": f"vector({float(planned)!r})"}]


def test_gateway_is_an_internal_nlb_open_only_to_the_environment(graphs: dict[str, Synthesis]) -> None:
    services = {s.inputs["metadata"]["name"]: s for s in graphs["prod-control"].of_type("kubernetes:core/v1:Service")}
    gateway = services["gateway"].inputs
    assert gateway["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
    assert set(gateway["spec"]["loadBalancerSourceRanges"]) == {"10.30.0.0/20", "10.31.0.0/16", "10.32.0.0/16"}
    # the scheduler: the serving datacenters (heartbeats) and the controller in the control VPC's management
    # subnets (weights); Prometheus, internal too: the controller alone (canary judge)
    controller = {"10.30.10.0/24", "10.30.11.0/24"}
    assert set(services["scheduler"].inputs["spec"]["loadBalancerSourceRanges"]) == {
        "10.31.0.0/16",
        "10.32.0.0/16",
        *controller,
    }
    prometheus = services["prometheus"].inputs
    assert prometheus["spec"]["type"] == "LoadBalancer"
    assert prometheus["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
    assert set(prometheus["spec"]["loadBalancerSourceRanges"]) == controller


def test_deployments_have_distinct_probes_requests_and_disruption_budgets(graphs: dict[str, Synthesis]) -> None:
    graph = graphs["prod-control"]
    for workload in graph.of_type("kubernetes:apps/v1:Deployment") + graph.of_type("kubernetes:apps/v1:StatefulSet"):
        for container in workload.inputs["spec"]["template"]["spec"]["containers"]:
            assert container["livenessProbe"] != container["readinessProbe"]
            assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    budgets = {b.inputs["metadata"]["name"] for b in graph.of_type("kubernetes:policy/v1:PodDisruptionBudget")}
    assert budgets == {"gateway", "scheduler"}
    hpa = graph.of_type("kubernetes:autoscaling/v2:HorizontalPodAutoscaler")[0].inputs
    assert hpa["spec"]["scaleTargetRef"]["name"] == "gateway" and hpa["spec"]["minReplicas"] == 3


def test_optional_lustre_file_system_is_encrypted_and_linked_to_the_bucket() -> None:
    graph = synthesize(STACKS / "Pulumi.dev-decode-us-east-2.yaml", {"pdstack-infra:lustre_capacity_gib": 1200})
    lustre = graph.of_type("aws:fsx/lustreFileSystem:LustreFileSystem")
    assert len(lustre) == 1 and lustre[0].inputs["kmsKeyId"] and lustre[0].inputs["storageCapacity"] == 1200
    link = graph.of_type("aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation")[0]
    assert link.inputs["dataRepositoryPath"] == "s3://pdstack-dev-decode-us-east-2-123456789012"
    assert graph.violations == []


def test_the_program_refuses_the_local_environment() -> None:
    with pytest.raises(SynthError, match="local environment is not deployed by Pulumi"):
        synthesize(STACKS / "Pulumi.dev-decode-us-east-2.yaml", {"pdstack:environment": "local"})


def test_a_bad_stack_config_is_refused_naming_the_field() -> None:
    cfg = stack_config("dev-decode-us-east-2").datacenter.model_dump(mode="json")
    cfg["pools"][0]["max_size"] = "two"
    with pytest.raises(SynthError, match=r"pdstack:datacenter\.pools\.0\.max_size"):
        synthesize(STACKS / "Pulumi.dev-decode-us-east-2.yaml", {"pdstack:datacenter": cfg})
