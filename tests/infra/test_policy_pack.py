"""The policy pack's registered policies, run through pulumi-policy's own argument types on the mocked resource
graphs: silent on the example stacks, and each one catches the edit it exists for."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2
from pulumi.runtime.proto import analyzer_pb2, analyzer_pb2_grpc
from pulumi_policy import (
    EnforcementLevel,
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from pdstack.contract.components import Component, contract
from pdstack.contract.files import environment_serving
from pdstack.policy import core, rules
from pdstack.policy.pack import policies
from pdstack.synth.synthesis import Resource, Synthesis
from tests.support import REPO

PROD = ("prod-control", "prod-prefill-us-east-1", "prod-decode-us-west-2")
# node_exporter's port, which the GPU nodes open to the control plane (infra/security.py)
METRICS_PORT = contract(environment_serving(REPO / "stacks", "prod")).node_exporter.port


@pytest.fixture(scope="module")
def pack() -> list[Any]:
    return policies()


def test_the_packs_entry_serves_every_rule_from_a_virtualenv_without_pdstack(tmp_path: Path) -> None:
    """policy/__main__.py run as Pulumi runs it, a script in the pack's virtualenv (pulumi and pulumi-policy, no
    pdstack): `-S` leaves out the .pth files, so this venv's site-packages holds everything but the editable pdstack."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    argv = [sys.executable, "-S", "-u", str(REPO / "policy" / "__main__.py")]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen(argv, cwd=tmp_path, env=env, text=True, **pipes) as pack:
        try:
            port = pack.stdout.readline().strip()  # the analyzer prints its port, then serves until it is killed
            if not port.isdigit():
                pack.kill()
                pytest.fail(f"the pack did not start: {pack.stderr.read()}")
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                info = analyzer_pb2_grpc.AnalyzerStub(channel).GetAnalyzerInfo(empty_pb2.Empty(), timeout=30)
        finally:
            pack.kill()
    assert info.name == "pdstack"
    assert [p.name for p in info.policies] == list(rules.POLICY_NAMES)
    assert {p.enforcementLevel for p in info.policies} == {analyzer_pb2.MANDATORY}


def _options(protect: bool = False) -> PolicyResourceOptions:
    timeouts = PolicyCustomTimeouts(0, 0, 0)
    return PolicyResourceOptions(
        protect=protect,
        ignore_changes=[],
        delete_before_replace=None,
        aliases=[],
        custom_timeouts=timeouts,
        additional_secret_outputs=[],
    )


def run_pack(
    pack: list[Any], resources: list[Resource], kv_port: int = 8400, kv_port_last: int | None = None
) -> list[tuple[str, str]]:
    """Every (policy, message) the pack reports, as the Pulumi engine would call it during a preview."""
    found: list[tuple[str, str]] = []
    config = {"kvPort": kv_port} | ({"kvPortLast": kv_port_last} if kv_port_last is not None else {})
    for policy in pack:

        def report(message: str, urn: str | None = None, name: str = policy.name) -> None:
            found.append((name, message))

        if isinstance(policy, ResourceValidationPolicy):
            for r in resources:
                args = ResourceValidationArgs(r.type, r.inputs, r.urn, r.name, _options(), None, config)
                policy.validate(args, report)
        else:
            assert isinstance(policy, StackValidationPolicy)
            policy.validate(StackValidationArgs(_policy_graph(resources), config), report)
    return found


def _policy_graph(resources: list[Resource]) -> list[PolicyResource]:
    """The graph as the engine hands it to a stack policy: each resource with its parent (registered before it)."""
    graph: dict[str, PolicyResource] = {}
    for r in resources:
        parent = graph.get(r.parent)
        graph[r.urn] = PolicyResource(r.type, r.inputs, r.urn, r.name, _options(r.protect), None, parent, [], {})
    return list(graph.values())


def test_the_pack_registers_every_rule_as_mandatory(pack: list[Any]) -> None:
    assert [p.name for p in pack] == list(rules.POLICY_NAMES)
    assert {p.enforcement_level for p in pack} == {EnforcementLevel.MANDATORY}


@pytest.mark.parametrize("name", PROD)
def test_the_pack_passes_the_prod_graphs(pack: list[Any], graphs: dict[str, Synthesis], name: str) -> None:
    assert run_pack(pack, graphs[name].resources) == []


def _edit(graph: Synthesis, type_: str, change: Callable[[dict[str, Any]], None], only: str = "") -> list[Resource]:
    """A copy of the graph with `change` applied to the first resource of `type_` (whose name `only` matches)."""
    edited, done = [], False
    for r in graph.resources:
        if not done and r.type == type_ and re.search(only, r.name):
            inputs = copy.deepcopy(r.inputs)
            change(inputs)
            edited.append(Resource(r.urn, r.type, r.name, r.parent, inputs, r.secret_inputs, r.protect))
            done = True
        else:
            edited.append(r)
    assert done, f"no {type_} {only!r} to edit"
    return edited


INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(inputs: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        target: Any = inputs
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[leaf] = value

    return change


EDITS = [
    (
        "kv port open to the world",
        INGRESS,
        _set("cidrIpv4", "0.0.0.0/0"),
        "-kv-",
        {"no-open-ingress", "kv-port-peers-only"},
    ),
    ("kv port open to all of 10/8", INGRESS, _set("cidrIpv4", "10.0.0.0/8"), "-kv-", {"kv-port-peers-only"}),
    ("metrics widened to cover the kv port", INGRESS, _set("fromPort", 1), "-metrics-", {"kv-port-peers-only"}),
    (
        "root volume unencrypted",
        TEMPLATE,
        _set("blockDeviceMappings.0.ebs.encrypted", "false"),
        "",
        {"encryption-at-rest"},
    ),
    ("IMDSv1 allowed", TEMPLATE, _set("metadataOptions.httpTokens", "optional"), "", {"imdsv2-required"}),
    (
        "a public address asked for on an EFA template's 32 interfaces",
        TEMPLATE,
        lambda i: [n.update(associatePublicIpAddress="false") for n in i["networkInterfaces"]],
        "",
        {"launch-template-interfaces"},
    ),
    (
        "EFA without cluster placement",
        "aws:ec2/placementGroup:PlacementGroup",
        _set("strategy", "spread"),
        "",
        {"efa-cluster-placement"},
    ),
    (
        "group reporting done with no instance",
        "aws:autoscaling/group:Group",
        _set("waitForCapacityTimeout", "0"),
        "",
        {"group-waits-for-capacity"},
    ),
    (
        "the node role's image pull narrowed to another repository",
        "aws:iam/rolePolicy:RolePolicy",
        lambda i: i.update(policy=i["policy"].replace("pdstack-prod/vllm", "pdstack-prod/prefill")),
        "-node$",
        {"node-images-pullable"},
    ),
    (
        "the node role may pull the gateway's image too",
        "aws:iam/rolePolicy:RolePolicy",
        lambda i: i.update(
            policy=i["policy"].replace(
                '"arn:aws:ecr:us-east-1:123456789012:repository/pdstack-prod/vllm"',
                '"arn:aws:ecr:us-east-1:123456789012:repository/pdstack-prod/vllm", '
                '"arn:aws:ecr:us-east-1:123456789012:repository/pdstack-prod/gateway"',
            )
        ),
        "-node$",
        {"node-images-pullable"},
    ),
    (
        "the node role without ECR's login",
        "aws:iam/rolePolicy:RolePolicy",
        lambda i: i.update(policy=i["policy"].replace("ecr:GetAuthorizationToken", "ecr:DescribeImages")),
        "-node$",
        {"node-images-pullable"},
    ),
    (
        "a template not saying which images its nodes run",
        TEMPLATE,
        lambda i: [s["tags"].pop("pdstack:images") for s in i["tagSpecifications"]],
        "",
        {"node-images-pullable"},
    ),
    (
        "a GPU template launching bare instances",
        TEMPLATE,
        lambda i: i.pop("userData"),
        "",
        {"gpu-template-has-user-data"},
    ),
    (
        "a drain hook that abandons a dead node",
        "aws:autoscaling/lifecycleHook:LifecycleHook",
        _set("defaultResult", "ABANDON"),
        "",
        {"gpu-group-drains"},
    ),
    (
        "the drain hook moved to launch: scale-in cuts requests",
        "aws:autoscaling/lifecycleHook:LifecycleHook",
        _set("lifecycleTransition", "autoscaling:EC2_INSTANCE_LAUNCHING"),
        "",
        {"gpu-group-drains"},
    ),
    ("instance tag dropped", "aws:autoscaling/group:Group", lambda i: i["tags"].pop(0), "", {"instance-tags"}),
    (
        "bucket versioning suspended",
        "aws:s3/bucketVersioning:BucketVersioning",
        _set("versioningConfiguration.status", "Suspended"),
        "",
        {"s3-buckets-protected"},
    ),
    (
        "bucket encryption dropped to SSE-S3",
        "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
        _set("rules.0.applyServerSideEncryptionByDefault.sseAlgorithm", "AES256"),
        "",
        {"encryption-at-rest"},
    ),
    (
        "the versioned model bucket passed off as a transfer bucket",
        "aws:s3/bucket:Bucket",
        lambda i: i["tags"].update({"pdstack:purpose": "ansible-transfer"}),
        "-models$",
        {"s3-buckets-protected"},
    ),
    ("key rotation off", "aws:kms/key:Key", _set("enableKeyRotation", False), "", {"encryption-at-rest"}),
]


@pytest.mark.parametrize(("what", "type_", "change", "only", "expected"), EDITS, ids=[e[0] for e in EDITS])
def test_the_pack_and_the_rules_catch_each_edit(  # noqa: PLR0917 (pytest parameters)
    pack: list[Any],
    graphs: dict[str, Synthesis],
    what: str,
    type_: str,
    change: Callable[[dict[str, Any]], None],
    only: str,
    expected: set[str],
) -> None:
    edited = _edit(graphs["prod-prefill-us-east-1"], type_, change, only)
    assert {policy for policy, _ in run_pack(pack, edited)} == expected
    direct = rules.evaluate([core.PolicyResource(r.type, r.name, r.urn, r.inputs, r.parent, r.protect) for r in edited])
    assert {v.policy for v in direct} == expected


CONTROL_EDITS = [
    (
        "gateway load balancer open to the world",
        "kubernetes:core/v1:Service",
        _set("spec.loadBalancerSourceRanges", ["0.0.0.0/0"]),
        "-gateway$",
        {"no-open-ingress"},
    ),
    (
        "gateway load balancer made public",
        "kubernetes:core/v1:Service",
        lambda i: i["metadata"]["annotations"].pop("service.beta.kubernetes.io/aws-load-balancer-internal"),
        "-gateway$",
        {"no-open-ingress", "internal-load-balancers"},
    ),
    (
        "gateway load balancer without its TLS certificate",
        "kubernetes:core/v1:Service",
        lambda i: i["metadata"]["annotations"].pop("service.beta.kubernetes.io/aws-load-balancer-ssl-cert"),
        "-gateway$",
        {"tls-listeners"},
    ),
    (
        "scheduler port left out of the TLS ports",
        "kubernetes:core/v1:Service",
        lambda i: i["metadata"]["annotations"].update(
            {"service.beta.kubernetes.io/aws-load-balancer-ssl-ports": "443"}  # not the port it listens on
        ),
        "-scheduler$",
        {"tls-listeners"},
    ),
    (
        "prometheus load balancer allowing TLS 1.0",
        "kubernetes:core/v1:Service",
        lambda i: i["metadata"]["annotations"].update(
            {"service.beta.kubernetes.io/aws-load-balancer-ssl-negotiation-policy": "ELBSecurityPolicy-2016-08"}
        ),
        "-prometheus$",
        {"tls-listeners"},
    ),
    (
        "readiness probe copied from liveness",
        "kubernetes:apps/v1:Deployment",
        lambda i: i["spec"]["template"]["spec"]["containers"][0].update(
            readinessProbe=i["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
        ),
        "gateway",
        {"probes-distinct"},
    ),
    (
        "EKS API opened publicly",
        "aws:eks/cluster:Cluster",
        _set("vpcConfig.publicAccessCidrs", ["0.0.0.0/0"]),
        "",
        {"no-open-ingress", "eks-reachable-by-pipeline"},
    ),
    (
        "secret without the environment key",
        "aws:secretsmanager/secret:Secret",
        lambda i: i.pop("kmsKeyId"),
        "",
        {"encryption-at-rest"},
    ),
]


@pytest.mark.parametrize(
    ("what", "type_", "change", "only", "expected"), CONTROL_EDITS, ids=[e[0] for e in CONTROL_EDITS]
)
def test_the_pack_catches_control_plane_edits(  # noqa: PLR0917 (pytest parameters)
    pack: list[Any],
    graphs: dict[str, Synthesis],
    what: str,
    type_: str,
    change: Callable[[dict[str, Any]], None],
    only: str,
    expected: set[str],
) -> None:
    edited = _edit(graphs["prod-control"], type_, change, only)
    assert {policy for policy, _ in run_pack(pack, edited)} == expected


def test_the_kv_port_comes_from_the_pack_config(pack: list[Any], graphs: dict[str, Synthesis]) -> None:
    # The metrics rule opens node_exporter's port to the control plane: with the KV port configured as that port
    # the pack must object to it.
    found = run_pack(pack, graphs["prod-prefill-us-east-1"].resources, kv_port=METRICS_PORT)
    assert {p for p, _ in found} == {"kv-port-peers-only"}


def test_every_kv_port_of_the_range_is_checked(pack: list[Any], graphs: dict[str, Synthesis]) -> None:
    """A vLLM prefill listens on one KV port per worker: the metrics port inside a configured range around it is
    caught, not only the range's ends."""
    low, high = METRICS_PORT - 2, METRICS_PORT + 1
    found = run_pack(pack, graphs["prod-prefill-us-east-1"].resources, kv_port=low, kv_port_last=high)
    assert {p for p, _ in found} == {"kv-port-peers-only"}
    assert any(f"KV ports {low}-{high}" in message for _, message in found)


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_the_rendered_pack_config_names_the_port_prefill_listens_on(
    pack: list[Any], graphs: dict[str, Synthesis], env: str
) -> None:
    """policy/config/<env>.json (pdstack.contract.components) is what `pulumi preview --policy-pack-config` gets: its
    KV port is the contract's, and the environment's stacks pass the pack under it."""
    config = json.loads((REPO / "policy" / "config" / f"{env}.json").read_text())["kv-port-peers-only"]
    ports = contract(environment_serving(REPO / "stacks", env))[Component.PREFILL].kv_ports
    assert (config["kvPort"], config["kvPortLast"]) == (ports[0], ports[-1])
    for name, graph in graphs.items():
        if name.startswith(f"{env}-"):
            assert run_pack(pack, graph.resources, config["kvPort"], config["kvPortLast"]) == [], name


LISTENER = "aws:lb/listener:Listener"
INTERNAL = {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}
PASSED_THROUGH = {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/16"], "ports": [{"port": 8100}]}
TLS_RESOURCES = [
    ("plain HTTP forwarded", LISTENER, {"protocol": "HTTP", "defaultActions": [{"type": "forward"}]}, True),
    ("plain TCP", LISTENER, {"protocol": "TCP", "port": 8000, "defaultActions": [{"type": "forward"}]}, True),
    (
        "TLS without a certificate",
        LISTENER,
        {"protocol": "TLS", "sslPolicy": "ELBSecurityPolicy-TLS13-1-2-2021-06"},
        True,
    ),
    (
        "TLS 1.0 allowed",
        LISTENER,
        {"protocol": "HTTPS", "certificateArn": "arn:c", "sslPolicy": "ELBSecurityPolicy-2016-08"},
        True,
    ),
    (
        "HTTP redirected to HTTPS",
        LISTENER,
        {
            "protocol": "HTTP",
            "defaultActions": [{"type": "redirect", "redirect": {"protocol": "HTTPS", "port": "443"}}],
        },
        False,
    ),
    (
        "TLS 1.2+ with a certificate",
        LISTENER,
        {"protocol": "TLS", "certificateArn": "arn:c", "sslPolicy": "ELBSecurityPolicy-TLS13-1-2-2021-06"},
        False,
    ),
    (
        "Ingress without tls",
        "kubernetes:networking.k8s.io/v1:Ingress",
        {"spec": {"rules": [{"host": "gateway.control.prod.pdstack.internal"}]}},
        True,
    ),
    (
        "Ingress with tls for its host",
        "kubernetes:networking.k8s.io/v1:Ingress",
        {"spec": {"rules": [{"host": "g.example"}], "tls": [{"hosts": ["g.example"], "secretName": "g"}]}},
        False,
    ),
    (
        "NodePort Service without TLS",
        "kubernetes:core/v1:Service",
        {"spec": {"type": "NodePort", "ports": [{"port": 8000}]}},
        True,
    ),
    (
        "Service passing TLS through to its pods",
        "kubernetes:core/v1:Service",
        {"metadata": {"annotations": {**INTERNAL, "pdstack.io/tls-passthrough": "true"}}, "spec": PASSED_THROUGH},
        False,
    ),
    (
        "Service passing TLS through and ending it too",
        "kubernetes:core/v1:Service",
        {
            "metadata": {
                "annotations": {
                    **INTERNAL,
                    "pdstack.io/tls-passthrough": "true",
                    "service.beta.kubernetes.io/aws-load-balancer-ssl-cert": "arn:c",
                }
            },
            "spec": PASSED_THROUGH,
        },
        True,
    ),
]


@pytest.mark.parametrize(("what", "type_", "props", "refused"), TLS_RESOURCES, ids=[t[0] for t in TLS_RESOURCES])
def test_the_pack_refuses_a_listener_without_tls(  # noqa: PLR0917 (pytest parameters)
    pack: list[Any], graphs: dict[str, Synthesis], what: str, type_: str, props: dict[str, Any], refused: bool
) -> None:
    """A listener the program does not make today (an ELB listener, an Ingress) is judged as the Services are: a
    violating one added to the real prod graph is refused by tls-listeners alone, a TLS one passes."""
    extra = Resource(f"urn:pulumi:prod-control::pdstack::{type_}::added", type_, "added", "", props, frozenset())
    found = {policy for policy, _ in run_pack(pack, [*graphs["prod-control"].resources, extra])}
    assert found == ({"tls-listeners"} if refused else set())
