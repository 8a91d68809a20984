"""The GPU node pools of the example stacks as EC2 and Auto Scaling would take them: launch templates EC2 accepts,
groups that wait for their capacity, images the nodes may pull, a pinned node image, and the operators' way in."""

from __future__ import annotations

import base64
import fnmatch
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from infra.node_pool import SESSION_ACTIONS, node_image_problem, node_policy
from infra.operator_access import session_document_name, transfer_bucket_name
from infra.registry import VLLM_IMAGE, node_images, repository_name
from infra.storage import bucket_name
from pdstack.cli import app
from pdstack.contract.components import scheduler_audience, scheduler_url_parameter
from pdstack.contract.node_lifecycle import (
    BUNDLE_PREFIX,
    DRAIN_HOOK,
    HEARTBEAT_MAX_S,
    MODEL_PREFIX,
    NODE_READABLE_PREFIXES,
    drain_timeout_seconds,
    node_group_name,
    node_role_name,
)
from pdstack.model import Engine, PoolRole
from pdstack.node import loader
from pdstack.node.userdata import node_config, render_user_data
from pdstack.policy import core, rules
from pdstack.stacks.environment import load_environment
from pdstack.stacks.files import load_stack_file
from pdstack.synth.synthesis import SynthError, Synthesis, mock_ami, peer_outputs, synthesize
from tests.pdstack.node.test_userdata import ENVIRONMENT_VALUES, MOTO, same_but_for_the_environment
from tests.support import REPO, STACKS

from .conftest import CLOUD_STACKS, stack_config

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
GPU_STACKS = [n for n in CLOUD_STACKS if not n.endswith("-control")]


@pytest.mark.parametrize("name", GPU_STACKS)
def test_only_a_single_interface_template_says_anything_about_public_addresses(
    graphs: dict[str, Synthesis], name: str
) -> None:
    """EC2 refuses AssociatePublicIpAddress when a launch names several interfaces (an EFA template has one per
    network card): those leave it unset; a one-interface template says false."""
    templates = graphs[name].of_type(LAUNCH_TEMPLATE)
    assert templates
    for template in templates:
        interfaces = template.inputs["networkInterfaces"]
        if len(interfaces) > 1:
            assert all("associatePublicIpAddress" not in i for i in interfaces), template.name
        else:
            assert interfaces[0]["associatePublicIpAddress"] == "false", template.name


def test_the_examples_hold_both_kinds_of_template(graphs: dict[str, Synthesis]) -> None:
    counts = {len(t.inputs["networkInterfaces"]) for n in GPU_STACKS for t in graphs[n].of_type(LAUNCH_TEMPLATE)}
    assert 1 in counts and max(counts) == 32  # p5.48xlarge: 32 EFA cards


GROUP = "aws:autoscaling/group:Group"


@pytest.mark.parametrize("name", GPU_STACKS)
def test_pulumi_up_waits_for_each_pools_instances_with_ec2_health_checks(
    graphs: dict[str, Synthesis], name: str
) -> None:
    groups = graphs[name].of_type(GROUP)
    assert groups
    for group in groups:
        assert group.inputs["waitForCapacityTimeout"] == "30m", group.name  # the default of the setting
        assert group.inputs["healthCheckType"] == "EC2"
        assert not group.inputs.get("ignoreFailedScalingActivities")  # a failed launch fails the update at once


def test_the_capacity_wait_is_the_stacks_setting_and_never_zero() -> None:
    path = STACKS / "Pulumi.dev-decode-us-east-2.yaml"
    graph = synthesize(path, {"pdstack-infra:capacity_wait_minutes": 45})
    assert {g.inputs["waitForCapacityTimeout"] for g in graph.of_type(GROUP)} == {"45m"}
    with pytest.raises(SynthError, match=r"pdstack-infra:capacity_wait_minutes: 0 is not between 1 and 240"):
        synthesize(path, {"pdstack-infra:capacity_wait_minutes": 0})


@pytest.mark.parametrize(
    ("timeout", "waits"), [(None, True), ("30m", True), ("1h0m", True), ("0", False), ("0s", False)]
)
def test_the_policy_refuses_a_group_that_does_not_wait(timeout: str | None, waits: bool) -> None:
    props = {} if timeout is None else {"waitForCapacityTimeout": timeout}
    found = rules.evaluate([core.PolicyResource(GROUP, "g", "urn:g", props)])
    assert [v.policy for v in found if v.policy == "group-waits-for-capacity"] == (
        [] if waits else ["group-waits-for-capacity"]
    )


def _node_policy(graph: Synthesis, pool_component: str) -> dict[str, dict]:
    policy = next(p for p in graph.of_type("aws:iam/rolePolicy:RolePolicy") if p.name == f"{pool_component}-node")
    return {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_every_image_a_node_runs_has_a_repository_its_role_may_pull_and_no_other(
    graphs: dict[str, Synthesis], env: str
) -> None:
    control = graphs[f"{env}-control"]
    repositories = {r.inputs["name"]: r for r in control.of_type("aws:ecr/repository:Repository")}
    assert set(repositories) == {f"pdstack-{env}/{i}" for i in ("gateway", "scheduler", "prefill", "decode", "vllm")}
    region = stack_config(f"{env}-control").datacenter.region
    engine = stack_config(f"{env}-control").serving.engine
    for name in (n for n in GPU_STACKS if n.startswith(f"{env}-")):
        cfg = stack_config(name)
        for pool in cfg.datacenter.pools:
            component = f"{cfg.datacenter.name}-{pool.name}"
            template = next(t for t in graphs[name].of_type(LAUNCH_TEMPLATE) if t.name == f"{component}-template")
            tags = next(s["tags"] for s in template.inputs["tagSpecifications"] if s["resourceType"] == "instance")
            runs = tags["pdstack:images"].split()
            assert runs == [f"pdstack-{env}/{i}" for i in node_images(engine, pool.role)]
            assert set(runs) <= set(repositories)  # the control stack makes each
            statements = _node_policy(graphs[name], component)
            assert statements["EcrLogin"] == {
                "Sid": "EcrLogin",
                "Effect": "Allow",
                "Action": "ecr:GetAuthorizationToken",
                "Resource": "*",  # ECR's token is not scoped to a repository
            }
            pull = statements["PullImages"]
            assert sorted(pull["Action"]) == sorted(
                ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
            )
            assert pull["Resource"] == [f"arn:aws:ecr:{region}:123456789012:repository/{r}" for r in runs]


def test_a_vllm_node_runs_the_vllm_image_and_a_pdserve_node_its_components() -> None:
    assert node_images(Engine.VLLM, PoolRole.PREFILL) == node_images(Engine.VLLM, PoolRole.DECODE) == ("vllm",)
    assert node_images(Engine.PDSERVE, PoolRole.DECODE) == ("decode",)
    assert node_images(Engine.VLLM, PoolRole.CONTROL) == ()


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_the_stacks_vllm_image_lives_in_the_repository_the_registry_makes(env: str) -> None:
    serving = stack_config(f"{env}-control").serving
    assert serving.vllm is not None
    path = serving.vllm.image.split("@", 1)[0].rsplit(":", 1)[0].split("/", 1)[1]  # registry host and tag off
    assert path == repository_name(env, VLLM_IMAGE)


DEBIAN_12 = re.compile(r"^/aws/service/debian/release/12/\d{8}-\d{4}/amd64$")


@pytest.mark.parametrize("name", GPU_STACKS)
def test_each_gpu_stack_pins_its_node_image_to_one_debian_12_version(graphs: dict[str, Synthesis], name: str) -> None:
    pinned = load_stack_file(STACKS / f"Pulumi.{name}.yaml").pulumi_config["pdstack-infra:node_image"]
    assert DEBIAN_12.match(pinned), pinned  # the version, never `latest`
    for template in graphs[name].of_type(LAUNCH_TEMPLATE):
        assert template.inputs["imageId"] == mock_ami(pinned)  # the parameter's value, read at `pulumi up`
        root = template.inputs["blockDeviceMappings"][0]
        assert root["deviceName"] == "/dev/xvda"  # Debian's root device: sized, not a second volume
        assert root["ebs"]["volumeSize"] == 200


def test_an_ami_id_is_taken_as_it_is() -> None:
    graph = synthesize(
        STACKS / "Pulumi.dev-prefill-us-east-1.yaml", {"pdstack-infra:node_image": "ami-0123456789abcdef0"}
    )
    assert {t.inputs["imageId"] for t in graph.of_type(LAUNCH_TEMPLATE)} == {"ami-0123456789abcdef0"}


@pytest.mark.parametrize(
    ("image", "why"),
    [
        ("/aws/service/debian/release/12/latest/amd64", r"moves \(latest\)"),
        ("/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id", "moves"),
        ("ami-XYZ", "neither an AMI id"),
        ("debian-12", "neither an AMI id"),
    ],
)
def test_a_moving_or_malformed_node_image_is_refused(image: str, why: str) -> None:
    with pytest.raises(SynthError, match=rf"pdstack-infra:node_image: .*{why}"):
        synthesize(STACKS / "Pulumi.dev-prefill-us-east-1.yaml", {"pdstack-infra:node_image": image})
    assert node_image_problem(image) is not None


def test_a_versioned_parameter_selector_pins_too() -> None:
    assert node_image_problem("/pdstack/node-image:3") is None
    assert node_image_problem("/pdstack/node-image/latest:3") is not None


def test_a_gpu_stack_without_a_pinned_image_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "stacks"
    shutil.copytree(STACKS, folder)
    path = folder / "Pulumi.dev-prefill-us-east-1.yaml"
    path.write_text("".join(line for line in path.read_text().splitlines(True) if "node_image" not in line))
    with pytest.raises(SynthError, match="pdstack-infra:node_image: datacenter prefill-us-east-1 runs GPU pools"):
        synthesize(path)
    assert synthesize(folder / "Pulumi.dev-control.yaml").resources  # the control stack's nodes are EKS's


@pytest.mark.parametrize("name", GPU_STACKS)
def test_operators_come_in_through_ssm_as_the_node_os_user_without_a_key(
    graphs: dict[str, Synthesis], name: str
) -> None:
    graph, cfg = graphs[name], stack_config(name)
    env, dc = str(cfg.environment), cfg.datacenter.name
    assert all("keyName" not in t.inputs for t in graph.of_type(LAUNCH_TEMPLATE))  # no key pair nobody made
    # the agent's session channel, inline: no managed policy (AmazonSSMManagedInstanceCore would allow every
    # parameter of the account)
    attached = graph.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
    assert not [a for a in attached if a.inputs["role"].endswith("-node")]  # the pool records' Lambda has its own
    for pool in cfg.datacenter.pools:
        session = _node_policy(graph, f"{dc}-{pool.name}")["SessionManager"]
        assert (sorted(session["Action"]), session["Resource"]) == (sorted(SESSION_ACTIONS), "*")
    document = next(d for d in graph.of_type("aws:ssm/document:Document") if d.name == f"{dc}-session")
    assert document.inputs["name"] == graph.outputs["session_document"] == session_document_name(env, dc)
    assert document.inputs["documentType"] == "Session"
    inputs = json.loads(document.inputs["content"])["inputs"]
    assert (inputs["runAsEnabled"], inputs["runAsDefaultUser"]) == (True, "admin")  # Debian's cloud user
    bucket = next(b for b in graph.of_type("aws:s3/bucket:Bucket") if b.name == f"{dc}-transfer")
    name_ = transfer_bucket_name(env, dc, "123456789012")
    assert bucket.inputs["bucket"] == graph.outputs["transfer_bucket"] == name_
    on_bucket = {r.type.rsplit(":", 1)[1]: r for r in graph.resources if r.inputs.get("bucket") == name_}
    assert "BucketVersioning" not in on_bucket  # no module's arguments kept in a version history
    rule = on_bucket["BucketLifecycleConfiguration"].inputs["rules"][0]
    assert rule["expiration"] == {"days": 1} and rule["filter"] == {"prefix": ""}
    assert (
        on_bucket["BucketServerSideEncryptionConfiguration"].inputs["rules"][0]["applyServerSideEncryptionByDefault"][
            "sseAlgorithm"
        ]
        == "aws:kms"
    )
    assert on_bucket["BucketPublicAccessBlock"].inputs["restrictPublicBuckets"] is True
    # the connection presigns every transfer on the controller: the nodes get no S3 permission on the bucket
    for policy in graph.of_type("aws:iam/rolePolicy:RolePolicy"):
        assert name_ not in policy.inputs["policy"], policy.name


def test_transfer_bucket_names_fit_s3_for_the_example_datacenters() -> None:
    for name in GPU_STACKS:
        cfg = stack_config(name)
        assert len(transfer_bucket_name(str(cfg.environment), cfg.datacenter.name, "123456789012")) <= 63


def _user_data(template: dict) -> str:
    return base64.b64decode(template["userData"]).decode()


@pytest.mark.parametrize("name", GPU_STACKS)
def test_every_gpu_template_carries_its_pools_user_data(graphs: dict[str, Synthesis], name: str) -> None:
    """Each pool's template boots its instances by themselves: the user data pdstack/node/userdata.py renders for
    that pool from the stack files, base64 as EC2 takes it."""
    cfg = stack_config(name)
    env = load_environment(STACKS, str(cfg.environment))
    templates = {t.name: t for t in graphs[name].of_type(LAUNCH_TEMPLATE)}
    for pool in cfg.datacenter.pools:
        template = templates[f"{cfg.datacenter.name}-{pool.name}-template"]
        assert _user_data(template.inputs) == render_user_data(cfg, env.control.config, pool.name)
    assert not [v for v in graphs[name].violations if v.policy == "gpu-template-has-user-data"]


def test_synths_user_data_is_what_a_local_dc2_decode_node_boots_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's check: the user data in `pdstack synth --stack prod-decode-us-west-2 --json` is the local dc2
    decode pool's, once the environment's values (node.json) are substituted."""
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(app, ["synth", "--stack", "prod-decode-us-west-2", "--json"])
    assert result.exit_code == 0, result.output
    [stack] = json.loads(result.output)["stacks"]
    [template] = [
        r
        for r in stack["resources"]
        if r["type"] == LAUNCH_TEMPLATE and r["name"] == "decode-us-west-2-decode-h200-template"
    ]
    local = load_environment(STACKS, "local")
    local_text = render_user_data(local.stack("local-dc2").config, local.control.config, "decode", MOTO)
    assert same_but_for_the_environment(_user_data(template["inputs"]), local_text) == ENVIRONMENT_VALUES


def _template(user_data: object, role: str = "decode") -> core.PolicyResource:
    props: dict = {"tagSpecifications": [{"resourceType": "instance", "tags": {"pdstack:role": role}}]}
    if user_data is not None:
        props["userData"] = user_data
    return core.PolicyResource(LAUNCH_TEMPLATE, "t", "urn:t", props)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    ("user_data", "role", "why"),
    [
        (_b64("#cloud-config\nruncmd: []\n"), "decode", None),
        (None, "control", None),  # EKS's nodes: not a GPU template
        (None, "prefill", "without user data"),
        ("", "decode", "without user data"),
        ("#cloud-config\n", "decode", "not base64"),
        (_b64("#!/bin/sh\necho hi\n"), "decode", "not a #cloud-config document"),
        (_b64("#cloud-config\n" + "x" * 16 * 1024), "decode", "over EC2's 16384"),
    ],
)
def test_the_policy_refuses_a_gpu_template_without_cloud_config(user_data: object, role: str, why: str | None) -> None:
    found = [v for v in rules.evaluate([_template(user_data, role)]) if v.policy == "gpu-template-has-user-data"]
    assert [v.message for v in found if why and why in v.message] == [v.message for v in found]
    assert len(found) == (0 if why is None else 1)


# --- the node role against what the bootstrap calls ---------------------------------------------------------------


def _allows(statements: list[dict], action: str, resource: str, via: str | None = None) -> list[str]:
    """The Sids of the Allow statements that let `action` on `resource` through (IAM's * and ? in Action and
    Resource; a kms:ViaService condition holds only for a call made through that service)."""
    found = []
    for statement in statements:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        condition = statement.get("Condition", {}).get("StringEquals", {})
        if set(statement.get("Condition", {})) - {"StringEquals"} or set(condition) - {"kms:ViaService"}:
            raise AssertionError(f"the test reads no such condition: {statement}")
        if (
            statement["Effect"] == "Allow"
            and any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in actions)
            and any(fnmatch.fnmatchcase(resource, r) for r in resources)
            and condition.get("kms:ViaService", via) == via
        ):
            found.append(statement["Sid"])
    return found


ACCOUNT = "123456789012"


def _bootstrap_calls(name: str, pool: str) -> tuple[list[tuple[str, str, str | None]], dict[str, str]]:
    """Every call a node of `pool` makes to AWS (docs/node-bootstrap.md, pdstack/node): (action, resource, the
    service a KMS call comes through), from the node.json its user data carries; and the ARNs they name."""
    cfg = stack_config(name)
    env = load_environment(STACKS, str(cfg.environment))
    node = node_config(cfg, env.control.config, pool, None)
    control = env.control.config.datacenter.region
    bucket = f"arn:aws:s3:::{bucket_name(str(node.environment), node.datacenter, ACCOUNT)}"
    group = f"pdstack-{node.environment}-{node.datacenter}-{pool}"
    assert group == node_group_name(str(node.environment), node.datacenter, pool)
    secret = f"arn:aws:secretsmanager:{control}:{ACCOUNT}:secret:{{}}-AbCdEf"
    arns = {
        "group": f"arn:aws:autoscaling:{node.region}:{ACCOUNT}:autoScalingGroup:"
        f"0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0:autoScalingGroupName/{group}",
        "bucket": bucket,
        "secret": secret,
        "control": control,
        # the keys as the mocks name them: the datacenter's (a resource here), the environment's (the control
        # stack's output)
        "data_key": f"arn:aws:kms:{node.region}:{ACCOUNT}:{node.datacenter}-data-key",
        "secrets_key": peer_outputs(f"{node.environment}-control", env.configs)["env_key_arn"],
    }
    calls: list[tuple[str, str, str | None]] = [
        ("ssm:GetParameter", f"arn:aws:ssm:{node.control_region}:{ACCOUNT}:parameter{node.release_parameter}", None),
        # the join phase: the scheduler's URL (pdstack.node.join.scheduler_url)
        (
            "ssm:GetParameter",
            f"arn:aws:ssm:{node.control_region}:{ACCOUNT}:parameter{scheduler_url_parameter(str(node.environment))}",
            None,
        ),
        *(("secretsmanager:GetSecretValue", secret.format(n), None) for n in [*node.secrets.values(), node.tls_secret]),
        ("kms:Decrypt", arns["secrets_key"], f"secretsmanager.{control}.amazonaws.com"),
        ("ecr:GetAuthorizationToken", "*", None),
        *(
            (action, f"arn:aws:ecr:{control}:{ACCOUNT}:repository/pdstack-{node.environment}/{image}", None)
            for image in node_images(
                env.control.config.serving.engine, next(p.role for p in cfg.datacenter.pools if p.name == pool)
            )
            for action in rules.ECR_PULL
        ),
        ("s3:GetObject", f"{bucket}/{BUNDLE_PREFIX}2026-12-06.1.tar.gz", None),  # and HEAD: download_file
        ("s3:GetObject", f"{bucket}/{MODEL_PREFIX}m/abc123/model-00001-of-00030.safetensors", None),
        ("kms:Decrypt", arns["data_key"], f"s3.{node.region}.amazonaws.com"),
        ("autoscaling:SetInstanceHealth", arns["group"], None),
        ("autoscaling:RecordLifecycleActionHeartbeat", arns["group"], None),
        ("autoscaling:CompleteLifecycleAction", arns["group"], None),
        # the SSM agent, for the operators' sessions
        *((action, "*", None) for action in SESSION_ACTIONS),
    ]
    return calls, arns


@pytest.mark.parametrize("name", GPU_STACKS)
def test_the_node_role_allows_what_the_bootstrap_calls_and_nothing_else(
    graphs: dict[str, Synthesis], name: str
) -> None:
    cfg = stack_config(name)
    for pool in cfg.datacenter.pools:
        statements = list(_node_policy(graphs[name], f"{cfg.datacenter.name}-{pool.name}").values())
        calls, arns = _bootstrap_calls(name, pool.name)
        used = set()
        for action, resource, via in calls:
            allowed = _allows(statements, action, resource, via)
            assert allowed, (pool.name, action, resource)
            used.update(allowed)
        assert used == {s["Sid"] for s in statements}, "a statement no call of the bootstrap needs"
        # every action a statement names is one the node calls
        called = {a.lower() for a, _, _ in calls}
        named = {
            a.lower() for s in statements for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
        }
        assert named == called
        env, dc = str(cfg.environment), cfg.datacenter.name
        other_env = "staging" if env == "prod" else "prod"
        neighbours = [
            (
                "ssm:GetParameter",
                f"arn:aws:ssm:{arns['control']}:{ACCOUNT}:parameter/pdstack/{other_env}/release",
                None,
            ),
            (
                "ssm:GetParameter",
                f"arn:aws:ssm:{arns['control']}:{ACCOUNT}:parameter/pdstack/{other_env}/scheduler-url",
                None,
            ),
            (
                "ssm:GetParameter",
                f"arn:aws:ssm:{arns['control']}:{ACCOUNT}:parameter/pdstack/{env}/ca-certificate",
                None,
            ),
            ("ssm:GetParameters", f"arn:aws:ssm:{arns['control']}:{ACCOUNT}:parameter/pdstack/{env}/release", None),
            ("s3:GetObject", f"{arns['bucket']}/elsewhere/x", None),
            ("s3:ListBucket", arns["bucket"], None),
            ("s3:PutObject", f"{arns['bucket']}/{MODEL_PREFIX}x", None),
            ("s3:GetObject", f"arn:aws:s3:::pdstack-{env}-{dc}-{ACCOUNT}-ssm/x", None),  # the transfer bucket
            ("kms:Decrypt", arns["data_key"], None),  # only through S3
            ("kms:GenerateDataKey", arns["data_key"], f"s3.{cfg.datacenter.region}.amazonaws.com"),
            ("secretsmanager:GetSecretValue", arns["secret"].format(f"pdstack/{env}/scheduler-identity-key"), None),
            *(
                ("secretsmanager:GetSecretValue", arns["secret"].format(f"pdstack/{env}/tls/{dc}/{p.name}"), None)
                for p in cfg.datacenter.pools
                if p.name != pool.name
            ),
            *(
                (
                    "autoscaling:SetInstanceHealth",
                    arns["group"].replace(f"/pdstack-{env}-{dc}-{pool.name}", f"/{g}"),
                    None,
                )
                for g in (f"pdstack-{env}-{dc}-{pool.name}-en", f"pdstack-{other_env}-{dc}-{pool.name}", "other")
            ),
            ("autoscaling:UpdateAutoScalingGroup", arns["group"], None),
            ("autoscaling:TerminateInstanceInAutoScalingGroup", arns["group"], None),
        ]
        for action, resource, via in neighbours:
            assert not _allows(statements, action, resource, via), (pool.name, action, resource)


# --- scale-in is a drain ------------------------------------------------------------------------------------------

HOOK = "aws:autoscaling/lifecycleHook:LifecycleHook"


@pytest.mark.parametrize("name", GPU_STACKS)
def test_each_gpu_group_drains_its_nodes_on_scale_in(graphs: dict[str, Synthesis], name: str) -> None:
    """A termination hook per group, by the contract's name, waiting as long as the environment's longest request
    and KV lease (and a settle) for the node to complete it, and terminating anyway after that."""
    cfg = stack_config(name)
    env = str(cfg.environment)
    serving = stack_config(f"{env}-control").serving
    groups = {g.inputs["name"]: g for g in graphs[name].of_type(GROUP)}
    hooks = {h.inputs["autoscalingGroupName"]: h for h in graphs[name].of_type(HOOK)}
    expected = {node_group_name(env, cfg.datacenter.name, p.name) for p in cfg.datacenter.pools}
    assert set(groups) == set(hooks) == expected
    timeout = drain_timeout_seconds(serving)
    assert timeout >= serving.timeouts.request_s + serving.timeouts.kv_lease_s
    for hook in hooks.values():
        assert hook.inputs["name"] == DRAIN_HOOK
        assert hook.inputs["lifecycleTransition"] == "autoscaling:EC2_INSTANCE_TERMINATING"
        assert (hook.inputs["defaultResult"], hook.inputs["heartbeatTimeout"]) == ("CONTINUE", timeout)
    # nothing on a node reads its tags from the metadata service: node.json says who it is
    for template in graphs[name].of_type(LAUNCH_TEMPLATE):
        assert template.inputs["metadataOptions"]["instanceMetadataTags"] == "disabled"


def test_the_drain_timeout_follows_the_stacks_timeouts_within_auto_scalings_bounds() -> None:
    serving = stack_config("prod-control").serving
    longer = serving.model_copy(update={"timeouts": serving.timeouts.model_copy(update={"request_s": 900.0})})
    assert drain_timeout_seconds(longer) == drain_timeout_seconds(serving) + 900 - int(serving.timeouts.request_s)
    endless = serving.model_copy(update={"timeouts": serving.timeouts.model_copy(update={"request_s": 86400.0})})
    assert drain_timeout_seconds(endless) == HEARTBEAT_MAX_S


@pytest.mark.parametrize(
    ("hooks", "why"),
    [
        ([("autoscaling:EC2_INSTANCE_TERMINATING", "CONTINUE", 720)], None),
        ([], "no termination lifecycle hook"),
        ([("autoscaling:EC2_INSTANCE_LAUNCHING", "CONTINUE", 720)], "no termination lifecycle hook"),
        ([("autoscaling:EC2_INSTANCE_TERMINATING", "ABANDON", 720)], "(CONTINUE)"),
        ([("autoscaling:EC2_INSTANCE_TERMINATING", "CONTINUE", 0)], "is not 30 to 7200"),
    ],
)
def test_the_policy_refuses_a_gpu_group_that_does_not_drain(hooks: list[tuple], why: str | None) -> None:
    tags = [{"key": "pdstack:role", "value": "decode", "propagateAtLaunch": True}]
    graph = [core.PolicyResource(GROUP, "g", "urn:g", {"name": "pdstack-prod-dc-decode", "tags": tags})]
    graph += [
        core.PolicyResource(
            HOOK,
            f"h{i}",
            f"urn:h{i}",
            {
                "name": DRAIN_HOOK,
                "autoscalingGroupName": "pdstack-prod-dc-decode",
                "lifecycleTransition": transition,
                "defaultResult": result,
                "heartbeatTimeout": timeout,
            },
        )
        for i, (transition, result, timeout) in enumerate(hooks)
    ]
    found = [v.message for v in rules.evaluate(graph) if v.policy == "gpu-group-drains"]
    assert found == ([] if why is None else [m for m in found if why in m])
    assert len(found) == (0 if why is None else 1)


SSM_AGENT = {"pdstack-infra:ssm_agent_version": "3.3.1802.0", "pdstack-infra:ssm_agent_sha256": "b" * 64}


def test_a_pinned_ssm_agent_reaches_every_gpu_templates_node_json() -> None:
    """pdstack-infra:ssm_agent_version and ssm_agent_sha256 become node.json's ssm_agent, which stage 0 installs."""
    graph = synthesize(STACKS / "Pulumi.dev-decode-us-east-2.yaml", SSM_AGENT)
    templates = [t for t in graph.of_type(LAUNCH_TEMPLATE) if "userData" in t.inputs]
    assert templates
    for template in templates:
        document = yaml.safe_load(_user_data(template.inputs))
        [node_json] = [f["content"] for f in document["write_files"] if f["path"] == str(loader.NODE_CONFIG)]
        assert json.loads(node_json)["ssm_agent"] == {"version": "3.3.1802.0", "sha256": "b" * 64}


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"pdstack-infra:ssm_agent_version": "3.3.1802.0"}, "ssm_agent_sha256: set with the other"),
        ({"pdstack-infra:ssm_agent_sha256": "b" * 64}, "ssm_agent_version: set with the other"),
        (SSM_AGENT | {"pdstack-infra:ssm_agent_version": "latest"}, "ssm_agent_version: 'latest' is not a version"),
        (SSM_AGENT | {"pdstack-infra:ssm_agent_sha256": "TODO"}, "ssm_agent_sha256: 'TODO' is not a sha256"),
    ],
)
def test_a_half_or_malformed_ssm_agent_pin_is_refused(settings: dict[str, str], why: str) -> None:
    with pytest.raises(SynthError, match=f"pdstack-infra:{why}"):
        synthesize(STACKS / "Pulumi.dev-decode-us-east-2.yaml", settings)


def _documented_node_permissions() -> dict[str, tuple[set[str], str]]:
    """docs/node-bootstrap.md's "What the node's role must allow": statement -> (actions, what it is on)."""
    text = (REPO / "docs" / "node-bootstrap.md").read_text(encoding="utf-8")
    section = text.split("## What the node's role must allow", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    return {sid.strip(" `"): ({a.strip(" `") for a in actions.split(",")}, on.strip()) for sid, actions, on in rows}


def test_the_docs_list_exactly_what_the_node_role_allows() -> None:
    """The manual's table of the node role is infra's node_policy, statement by statement and action by action:
    the release objects' prefixes the contract's, and no ListBucket."""
    arns: dict[str, Any] = {
        "release": "arn:aws:ssm:us-east-1:1:parameter/pdstack/dev/release",
        "scheduler_url": "arn:aws:ssm:us-east-1:1:parameter/pdstack/dev/scheduler-url",
        "secrets": ["arn:aws:secretsmanager:us-east-1:1:secret:pdstack/dev/x"],
        "secrets_key": "arn:aws:kms:us-east-1:1:key/s",
        "bucket": "arn:aws:s3:::b",
        "volume_key": "arn:aws:kms:us-west-2:1:key/v",
        "repositories": ["arn:aws:ecr:us-east-1:1:repository/pdstack-dev/decode"],
        "group": "arn:aws:autoscaling:us-west-2:1:autoScalingGroup:*:autoScalingGroupName/g",
    }
    statements = json.loads(node_policy(arns, secrets_region="us-east-1", region="us-west-2"))["Statement"]
    granted = {s["Sid"]: {s["Action"]} if isinstance(s["Action"], str) else set(s["Action"]) for s in statements}
    documented = _documented_node_permissions()
    assert {sid: actions for sid, (actions, _) in documented.items()} == granted
    [objects] = [s for s in statements if s["Sid"] == "ReadReleaseObjects"]
    assert objects["Resource"] == [f"arn:aws:s3:::b/{prefix}*" for prefix in NODE_READABLE_PREFIXES]
    assert all(f"`{prefix}*`" in documented["ReadReleaseObjects"][1] for prefix in NODE_READABLE_PREFIXES)
    assert not any("ListBucket" in action for actions in granted.values() for action in actions)


# --- joining the scheduler ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_the_scheduler_admits_the_joins_of_exactly_the_node_roles_the_datacenter_stacks_make(
    graphs: dict[str, Synthesis], env: str
) -> None:
    """The control stack's scheduler runs with join on: join_node_roles names each GPU pool's node role (its fixed
    name, which the datacenter stack gives the role) with the pool's role, the environment's audience, STS in the
    control region; what the node's bootstrap signs for (scheduler_audience, the control region)."""
    from pdserve.common.settings import load_settings  # noqa: PLC0415
    from pdserve.scheduler.settings import SchedulerSettings  # noqa: PLC0415

    control = graphs[f"{env}-control"]
    [scheduler] = [
        d for d in control.of_type("kubernetes:apps/v1:Deployment") if d.inputs["metadata"]["name"] == "scheduler"
    ]
    container = scheduler.inputs["spec"]["template"]["spec"]["containers"][0]
    environ = {e["name"]: e["value"] for e in container["env"]}
    settings = load_settings(SchedulerSettings, list(container["args"])[1:], prog="pdserve scheduler", env=environ)
    expected = {}
    for name in [n for n in GPU_STACKS if n.startswith(f"{env}-")]:
        cfg = stack_config(name)
        for pool in cfg.datacenter.pools:
            role = next(
                r
                for r in graphs[name].of_type("aws:iam/role:Role")
                if r.name == f"{cfg.datacenter.name}-{pool.name}-node"
            )
            assert role.inputs["name"] == node_role_name(env, cfg.datacenter.name, pool.name)
            expected[("aws", ACCOUNT, role.inputs["name"])] = str(pool.role)
    assert expected
    assert settings.node_roles() == expected
    assert settings.join_audience == scheduler_audience(env) == f"pdstack-{env}-scheduler"
    control_region = load_environment(STACKS, env).control.config.datacenter.region
    assert settings.sts_url() == f"https://sts.{control_region}.amazonaws.com/"
