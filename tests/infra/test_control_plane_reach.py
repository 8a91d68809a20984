"""#36's control-plane stack under the mocks: the pipeline reaches the EKS API (public to named CIDRs only) with access
entries for its deploy and plan roles; internal load balancers have subnets to land in; metrics-server serves the
gateway's HPA; stateful resources are protected; no output holds a secret; no EKS node template puts instance tags in
the metadata; no Lambda reserves concurrency. Each also as a policy rule on a hand-made graph."""

from __future__ import annotations

import re

import pytest

from infra.control_plane import CLUSTER_ADMIN_POLICY, READ_ONLY_POLICY
from infra.network import INTERNAL_ELB_TAG, PUBLIC_ELB_TAG
from pdstack.policy import core, rules
from pdstack.stacks.files import load_stack_file
from pdstack.synth.synthesis import SynthError, Synthesis, synthesize
from tests.support import STACKS

from .conftest import CLOUD_STACKS

CONTROL_STACKS = [n for n in CLOUD_STACKS if n.endswith("-control")]


def _settings(name: str) -> dict[str, object]:
    return load_stack_file(STACKS / f"Pulumi.{name}.yaml").pulumi_config


@pytest.mark.parametrize("name", CONTROL_STACKS)
def test_the_pipeline_reaches_the_cluster_with_its_roles(graphs: dict[str, Synthesis], name: str) -> None:
    graph, settings = graphs[name], _settings(name)
    (cluster,) = graph.of_type(core.EKS_CLUSTER)
    assert cluster.prop("accessConfig.authenticationMode") == "API"
    assert cluster.prop("accessConfig.bootstrapClusterCreatorAdminPermissions") is False
    assert cluster.prop("vpcConfig.endpointPrivateAccess") is True
    assert cluster.prop("vpcConfig.endpointPublicAccess") is True
    assert cluster.prop("vpcConfig.publicAccessCidrs") == settings["pdstack-infra:eks_public_access_cidrs"]
    entries = {e.inputs["principalArn"]: e for e in graph.of_type("aws:eks/accessEntry:AccessEntry")}
    policies = {a.inputs["principalArn"]: a.inputs for a in graph.of_type(core.EKS_ACCESS_POLICY)}
    deploy, plan = settings["pdstack-infra:deploy_role_arn"], settings["pdstack-infra:plan_role_arn"]
    assert set(entries) == set(policies) == {deploy, plan}
    assert policies[deploy]["policyArn"] == CLUSTER_ADMIN_POLICY
    assert policies[plan]["policyArn"] == READ_ONLY_POLICY
    assert all(p["accessScope"] == {"type": "cluster"} for p in policies.values())


@pytest.mark.parametrize("name", CONTROL_STACKS)
def test_internal_load_balancers_land_in_the_service_subnets(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    tagged = {s.prop("tags.pdstack:tier"): s.prop("tags", {}) for s in graph.of_type(core.SUBNET)}
    assert tagged["service"][INTERNAL_ELB_TAG] == "1"
    for subnet in graph.of_type(core.SUBNET):
        tags = subnet.prop("tags", {})
        assert PUBLIC_ELB_TAG not in tags
        assert (INTERNAL_ELB_TAG in tags) == (tags["pdstack:tier"] == "service"), subnet.name
    scheduler = next(s for s in graph.of_type(core.K8S_SERVICE) if s.prop("metadata.name") == "scheduler")
    assert scheduler.prop("spec.type") == "LoadBalancer"
    assert scheduler.prop("metadata.annotations")["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"


@pytest.mark.parametrize("name", CONTROL_STACKS)
def test_metrics_server_serves_the_gateways_hpa(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    assert graph.of_type(core.HPA)
    assert "metrics-server" in {a.inputs["addonName"] for a in graph.of_type(core.EKS_ADDON)}


@pytest.mark.parametrize("name", CLOUD_STACKS)
def test_stateful_resources_protected_and_no_secret_outputs(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    stateful = [r for r in graph.resources if r.type in core.STATEFUL_TYPES]
    assert stateful and all(r.protect for r in stateful), [r.name for r in stateful if not r.protect]
    # what holds data is also retained if a replacement gets past protection: keys, model buckets, secrets
    retained = {r.type for r in graph.resources if r.retain_on_delete}
    assert retained == {t for t in (core.KMS_KEY, core.SECRET, core.BUCKET) if graph.of_type(t)}
    assert not any(r.retain_on_delete for r in graph.of_type(core.BUCKET) if "transfer" in r.name)
    assert graph.secret_outputs == set() and "secret_values" not in graph.outputs
    assert graph.violations == []
    for template in graph.of_type(core.LAUNCH_TEMPLATE):
        assert template.prop("metadataOptions.instanceMetadataTags") != "enabled", template.name
    for function in graph.of_type(core.LAMBDA_FUNCTION):
        assert "reservedConcurrentExecutions" not in function.inputs, function.name


def test_a_control_stack_needs_the_pipelines_roles_and_cidrs() -> None:
    path = STACKS / "Pulumi.staging-control.yaml"
    with pytest.raises(SynthError, match=r"deploy_role_arn: required of a control stack"):
        synthesize(path, {"pdstack-infra:deploy_role_arn": ""})
    with pytest.raises(SynthError, match=re.escape("plan_role_arn: 'arn:aws:iam::1:role/x' is not an IAM role ARN")):
        synthesize(path, {"pdstack-infra:plan_role_arn": "arn:aws:iam::1:role/x"})
    with pytest.raises(SynthError, match=r"protect: only a dev stack"):
        synthesize(path, {"pdstack-infra:protect": False})


def test_a_dev_stack_may_leave_its_resources_unprotected() -> None:
    graph = synthesize(STACKS / "Pulumi.dev-control.yaml", {"pdstack-infra:protect": False})
    assert not any(r.protect for r in graph.resources) and graph.violations == []


def _resource(type_: str, props: dict[str, object], *, protect: bool = False) -> core.PolicyResource:
    return core.PolicyResource(type_, f"r-{type_.rsplit(':', 1)[1]}", f"urn:{type_}", props, protect=protect)


def _found(graph: list[core.PolicyResource], config: core.PolicyConfig | None = None) -> set[tuple[str, str]]:
    return {(v.policy, v.message) for v in rules.evaluate(graph, config)}


def test_the_rules_catch_what_the_issue_found() -> None:
    cluster = _resource(
        core.EKS_CLUSTER,
        {
            "accessConfig": {"authenticationMode": "CONFIG_MAP"},
            "vpcConfig": {"endpointPublicAccess": False},
            "encryptionConfig": {"resources": ["secrets"]},
        },
    )
    graph = [
        cluster,
        _resource(core.SUBNET, {"tags": {PUBLIC_ELB_TAG: "1"}}),
        _resource(core.K8S_SERVICE, {"metadata": {"name": "scheduler"}, "spec": {"type": "LoadBalancer"}}),
        _resource(core.HPA, {}),
        _resource(core.LAMBDA_FUNCTION, {"reservedConcurrentExecutions": 1}),
        _resource(core.STACK, {"secret_values": {core.SECRET_SIGNATURE[0]: core.SECRET_SIGNATURE[1], "value": "x"}}),
    ]
    found = {policy for policy, _ in _found(graph)}
    assert {
        "stateful-resources-protected",
        "no-secret-outputs",
        "eks-reachable-by-pipeline",
        "internal-load-balancers",
        "hpa-has-metrics",
        "no-reserved-concurrency",
    } <= found
    reach = {m for p, m in _found(graph) if p == "eks-reachable-by-pipeline"}
    assert len(reach) == 4  # authentication mode, private endpoint, no admin entry, no read-only entry
    opened = _resource(
        core.EKS_CLUSTER,
        {
            "accessConfig": {"authenticationMode": "API"},
            "vpcConfig": {"endpointPublicAccess": True, "publicAccessCidrs": ["0.0.0.0/0"]},
        },
        protect=True,
    )
    assert (
        "eks-reachable-by-pipeline",
        "the API endpoint is public to 0.0.0.0/0, not to the pipeline's named CIDRs",
    ) in _found([opened])
    unprotected = {p for p, _ in _found([cluster], core.PolicyConfig(protect_stateful=False))}
    assert "stateful-resources-protected" not in unprotected
