"""`pdstack synth`: run the Pulumi program of one stack under mocks, offline, and list what it would create.

The program in infra/ runs in-process against a mock engine: no Pulumi CLI, no cloud, no credentials. Each
resource registration is recorded (type, name, parent, inputs as the engine receives them); invokes (caller
identity, availability zones, the node image's SSM parameter) and StackReferences get answers derived from the
environment's stack files. The policy pack's rules (pdstack.policy.rules) then judge the recorded graph.
(pdstack.synth.report prints the result.)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime import rpc, settings
from pulumi.runtime.config import set_all_config
from pulumi.runtime.mocks import MockMonitor
from pulumi.runtime.sync_await import _sync_await

from infra.program import main as program_main
from infra.registry import environment_images
from pdstack.contract.components import cloud_names, contract
from pdstack.contract.files import KV_PORT_POLICY, policy_config
from pdstack.model import LOCAL_REGION, DatacenterRole, StackConfig
from pdstack.policy import core, rules
from pdstack.stacks.environment import EnvironmentLoadError, load_environment
from pdstack.stacks.files import StackFile, load_stack_file

PROJECT = "pdstack"
ORGANIZATION = "organization"
MOCK_ACCOUNT = "123456789012"
REDACTED = "[secret]"
SECRET_SIG = "4dabf18193072939515e22adb298388d"  # noqa: S105 (Pulumi's wire marker of a secret, not one)
SECRET_VALUE_SIG = "1b47061264138c4ac30d75fd1eb44270"  # noqa: S105 (likewise)


@dataclass(frozen=True)
class Resource:
    urn: str
    type: str
    name: str
    parent: str
    inputs: dict[str, Any]
    secret_inputs: frozenset[str]  # top-level input names that arrived as secrets
    protect: bool = False  # the resource option protect
    retain_on_delete: bool = False  # the resource option retain_on_delete

    def prop(self, path: str, default: Any = None) -> Any:
        value: Any = self.inputs
        for part in path.split("."):
            if isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            elif isinstance(value, dict) and part in value:
                value = value[part]
            else:
                return default
        return value


@dataclass
class Synthesis:
    stack: str
    resources: list[Resource] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    secret_outputs: set[str] = field(default_factory=set)
    violations: list[core.Violation] = field(default_factory=list)
    skipped: str | None = None  # why nothing was synthesised (the local environment)
    policies_checked: int = 0

    def of_type(self, type_: str) -> list[Resource]:
        return [r for r in self.resources if r.type == type_]

    def children_of(self, resource: Resource) -> list[Resource]:
        return [r for r in self.resources if r.parent == resource.urn]


class SynthError(Exception):
    """The program refused the stack (bad config) or failed; the message says why."""


def stack_path(stacks_dir: Path, name: str) -> Path:
    path = stacks_dir / f"Pulumi.{name}.yaml"
    if not path.is_file():
        known = sorted(p.name[len("Pulumi.") : -len(".yaml")] for p in stacks_dir.glob("Pulumi.*.yaml"))
        raise SynthError(f"no stack {name!r} in {stacks_dir} (known: {', '.join(known)})")
    return path


def synthesize(path: Path, config_overrides: dict[str, Any] | None = None) -> Synthesis:
    """Run the program for the stack file at `path`; `config_overrides` replace keys of its `config:` block."""
    stack = load_stack_file(path)
    result = Synthesis(stack=stack.stack_name)
    if stack.config.datacenter.region == LOCAL_REGION:
        result.skipped = "the local environment is deployed by Ansible on this machine, not by Pulumi"
        return result
    config = {**stack.pulumi_config, **(config_overrides or {})}
    environment = _environment(path.parent, stack)
    recorder = _run(stack, config, environment, result)
    result.resources = recorder
    graph = [core.PolicyResource(r.type, r.name, r.urn, r.inputs, r.parent, r.protect) for r in result.resources]
    graph.append(_stack_resource(result))
    protect = config.get("pdstack-infra:protect", True) not in (False, "false")
    result.violations = rules.evaluate(graph, replace(_policy_config(environment), protect_stateful=protect))
    result.policies_checked = len(rules.POLICY_NAMES)
    return result


def _stack_resource(result: Synthesis) -> core.PolicyResource:
    """The stack itself as the policy pack sees it: its outputs as props, a secret one in Pulumi's secret envelope."""
    sig, value_sig = core.SECRET_SIGNATURE
    props = {
        key: {sig: value_sig, "value": "[secret]"} if key in result.secret_outputs else value
        for key, value in result.outputs.items()
    }
    return core.PolicyResource(core.STACK, result.stack, f"urn:pulumi:{result.stack}::stack", props)


def _environment(stacks_dir: Path, stack: StackFile) -> dict[str, StackConfig]:
    """The stack's environment as the program sees it (pdstack.stacks.environment, the one loader); its own config
    wins."""
    try:
        configs = load_environment(stacks_dir, str(stack.config.environment)).configs
    except EnvironmentLoadError as exc:
        raise SynthError(str(exc)) from None
    configs[stack.config.datacenter.name] = stack.config
    return configs


def _policy_config(environment: dict[str, StackConfig]) -> core.PolicyConfig:
    """The pack's config as `pulumi preview` gets it from policy/config/<env>.json
    (pdstack.contract.files.policy_config)."""
    serving = next((cfg.serving for cfg in environment.values() if cfg.serving is not None), None)
    if serving is None:
        return core.PolicyConfig()
    return core.PolicyConfig.from_pack_config(policy_config(contract(serving))[KV_PORT_POLICY])


def _config_strings(config: dict[str, Any]) -> dict[str, str]:
    """Pulumi hands config to programs as strings; structured values travel as JSON."""
    return {key: value if isinstance(value, str) else json.dumps(value, default=str) for key, value in config.items()}


def _run(
    stack: StackFile, config: dict[str, Any], environment: dict[str, StackConfig], result: Synthesis
) -> list[Resource]:
    mocks = GraphMocks(stack.config.datacenter.region, environment)
    monitor = RecordingMonitor(mocks)
    settings.ROOT.set(None)  # a fresh root stack resource per run: outputs of an earlier run must not leak
    # The SDK registers resources on the thread's current event loop; an earlier asyncio.run() in the same process
    # (a caller, or another test) leaves none set, and then the mocks refuse to start.
    asyncio.set_event_loop(asyncio.new_event_loop())
    pulumi.runtime.set_mocks(
        mocks, project=PROJECT, stack=stack.stack_name, preview=False, monitor=monitor, organization=ORGANIZATION
    )
    set_all_config(_config_strings(config))
    # The SDK's own test runner: runs the program, then waits for every registration and output to settle.
    as_test: Callable[[Callable[[], None]], Callable[[], None]] = pulumi.runtime.test
    try:
        as_test(program_main)()
    except pulumi.RunError as exc:
        raise SynthError(f"{stack.stack_name}: {exc}") from None
    root_resource = settings.get_root_resource()
    exported = getattr(root_resource, "outputs", {}) or {}
    for key, value in exported.items():
        out = pulumi.Output.from_input(value)
        result.outputs[key] = _sync_await(out.future())
        if _sync_await(out.is_secret()):
            result.secret_outputs.add(key)
    return monitor.recorded


def _unwrap(value: Any) -> tuple[Any, bool]:
    """Strip Pulumi's secret wrappers from a deserialized value; report whether any were present."""
    if isinstance(value, dict):
        if value.get(SECRET_SIG) == SECRET_VALUE_SIG:
            return _unwrap(value.get("value"))[0], True
        pairs = {k: _unwrap(v) for k, v in value.items()}
        return {k: v for k, (v, _) in pairs.items()}, any(s for _, s in pairs.values())
    if isinstance(value, list):
        items = [_unwrap(v) for v in value]
        return [v for v, _ in items], any(s for _, s in items)
    if isinstance(value, float) and value.is_integer():
        return int(value), False  # the wire carries every number as a double
    return value, False


class RecordingMonitor(MockMonitor):  # type: ignore[misc]
    """The mock monitor, also keeping each registration's parent and raw inputs (secrets marked)."""

    def __init__(self, mocks: GraphMocks) -> None:
        super().__init__(mocks)
        self.recorded: list[Resource] = []

    def RegisterResource(self, request: Any) -> Any:  # the gRPC method name
        response = super().RegisterResource(request)
        if request.type != "pulumi:pulumi:Stack":
            self._record(response.urn, request, request.object)
        return response

    def ReadResource(self, request: Any) -> Any:  # StackReferences are read, not registered
        response = super().ReadResource(request)
        self._record(response.urn, request, request.properties)
        return response

    def _record(self, urn: str, request: Any, properties: Any) -> None:
        raw = rpc.deserialize_properties(properties, keep_internal=False)
        inputs, secret = {}, set()
        for key, value in raw.items():
            inputs[key], is_secret = _unwrap(value)
            if is_secret:
                secret.add(key)
        protect, retain = bool(getattr(request, "protect", False)), bool(getattr(request, "retainOnDelete", False))
        self.recorded.append(
            Resource(urn, request.type, request.name, request.parent, inputs, frozenset(secret), protect, retain)
        )


class GraphMocks(pulumi.runtime.Mocks):  # type: ignore[misc]
    """Answers the engine would give: ids and computed properties, invokes, peer stack outputs."""

    def __init__(self, region: str, environment: dict[str, StackConfig]) -> None:
        self.region, self.environment = region, environment

    def new_resource(self, args: Any) -> tuple[str, dict[str, Any]]:
        inputs, _ = _unwrap(dict(args.inputs))
        state = {**inputs, **_computed(args.typ, args.name, inputs, self.region, self.environment)}
        return f"{args.name}-id", state

    def call(self, args: Any) -> tuple[dict[str, Any], list[Any]]:
        function = args.token
        if function == "aws:index/getCallerIdentity:getCallerIdentity":
            arn = f"arn:aws:iam::{MOCK_ACCOUNT}:user/ci"
            return {"accountId": MOCK_ACCOUNT, "arn": arn, "userId": "AIDAMOCK", "id": MOCK_ACCOUNT}, []
        if function == "aws:index/getAvailabilityZones:getAvailabilityZones":
            names = [f"{self.region}{z}" for z in "abc"]
            return {"names": names, "zoneIds": [f"use-az{i}" for i in range(3)], "id": self.region}, []
        if function == "aws:ssm/getParameter:getParameter":
            name = args.args["name"]
            return {"name": name, "value": mock_ami(name), "type": "String", "id": name}, []
        raise SynthError(f"the mock engine has no answer for invoke {function}")


TLS_STAND_INS = {
    "tls:index/privateKey:PrivateKey": ("privateKeyPem", "publicKeyPem"),
    "tls:index/selfSignedCert:SelfSignedCert": ("certPem",),
    "tls:index/certRequest:CertRequest": ("certRequestPem",),
    "tls:index/locallySignedCert:LocallySignedCert": ("certPem",),
}


def _computed(  # noqa: PLR0911 (one answer per resource type whose computed outputs the program reads)
    type_: str, name: str, inputs: dict[str, Any], region: str, environment: dict[str, StackConfig]
) -> dict[str, Any]:
    digest = hashlib.sha256(f"{type_}/{name}".encode()).hexdigest()
    service = type_.split(":")[1].split("/", 1)[0] if ":" in type_ else "mock"
    common = {"arn": f"arn:aws:{service}:{region}:{MOCK_ACCOUNT}:{name}", "name": inputs.get("name", name)}
    if type_ == "pulumi:pulumi:StackReference":
        return {"outputs": peer_outputs(str(inputs["name"]), environment)}
    if type_ == "aws:s3/bucket:Bucket":
        bucket = inputs.get("bucket", name)
        return {"bucket": bucket, "arn": f"arn:aws:s3:::{bucket}"}
    if type_ == "aws:eks/cluster:Cluster":
        endpoint = f"https://{digest[:32].upper()}.gr7.{region}.eks.amazonaws.com"
        return {**common, "endpoint": endpoint, "certificateAuthority": {"data": "bW9jay1jYQ=="}}
    if type_ == "aws:ecr/repository:Repository":
        return {**common, "repositoryUrl": f"{MOCK_ACCOUNT}.dkr.ecr.{region}.amazonaws.com/{common['name']}"}
    if type_ == "aws:kms/key:Key":
        return {**common, "keyId": digest[:36]}
    if type_ == "aws:ec2/launchTemplate:LaunchTemplate":
        return {**common, "latestVersion": 1}
    if type_ == "random:index/randomPassword:RandomPassword":
        return {"result": f"mock-{digest[:40]}"}  # a stand-in, not a secret: mocks never see real values
    if type_ == "aws:route53/zone:Zone":
        return {**common, "zoneId": mock_zone_id(str(inputs["name"]))}
    if type_ in TLS_STAND_INS:  # PEM stand-ins for pulumi-tls's outputs: keys marked like generated secrets
        return {out: f"{'mock' if 'Key' in out else 'public'}-{out}-{digest[:40]}" for out in TLS_STAND_INS[type_]}
    return common


def mock_ami(parameter: str) -> str:
    """The AMI an SSM parameter names: one per parameter (and version), so a graph shows which one it read."""
    return "ami-" + hashlib.sha256(parameter.encode()).hexdigest()[:17]


def mock_zone_id(zone: str) -> str:
    """A Route53 zone's id, the same for the stack that makes the zone and the stacks that read it."""
    return "Z" + hashlib.sha256(zone.encode()).hexdigest()[:20].upper()


def peer_outputs(qualified_stack: str, environment: dict[str, StackConfig]) -> dict[str, Any]:
    """What a deployed peer stack would export (infra/outputs.py names), derived from its stack file."""
    stack = qualified_stack.rsplit("/", 1)[-1]
    cfg = next((c for c in environment.values() if f"{c.environment}-{c.datacenter.name}" == stack), None)
    if cfg is None:
        raise SynthError(f"StackReference to {qualified_stack}: no such stack in the environment")
    dc = cfg.datacenter
    ids = hashlib.sha256(stack.encode()).hexdigest()
    values: dict[str, Any] = {
        "region": dc.region,
        "account_id": MOCK_ACCOUNT,
        "cidr": str(dc.cidr),
        "vpc_id": f"vpc-{ids[:17]}",
        "private_route_table_ids": [f"rtb-{ids[i : i + 17]}" for i in (17, 34)],
        "transit_gateway_id": f"tgw-{ids[:17]}",
        "transit_gateway_route_table_id": f"tgw-rtb-{ids[17:34]}",
        "data_key_arn": f"arn:aws:kms:{dc.region}:{MOCK_ACCOUNT}:key/{ids[:36]}",
    }
    if dc.role is DatacenterRole.CONTROL:
        env = cfg.environment
        values["env_key_arn"] = f"arn:aws:kms:{dc.region}:{MOCK_ACCOUNT}:key/{ids[28:64]}"
        values["secret_arns"] = {
            s.name: f"arn:aws:secretsmanager:{dc.region}:{MOCK_ACCOUNT}:secret:pdstack/{env}/{s.name}-AbCdEf"
            for s in cfg.secret_specs
        }
        values["private_zone_name"] = cloud_names(str(env)).zone
        values["private_zone_id"] = mock_zone_id(values["private_zone_name"])
        values["tls_secret_arns"] = {
            c.datacenter.name: {
                p.name: f"arn:aws:secretsmanager:{dc.region}:{MOCK_ACCOUNT}:secret:pdstack/{env}/tls/"
                f"{c.datacenter.name}/{p.name}-AbCdEf"
                for p in c.datacenter.pools
            }
            for c in environment.values()
            if c.datacenter.role is not DatacenterRole.CONTROL
        }
        values["repository_arns"] = {
            image: f"arn:aws:ecr:{dc.region}:{MOCK_ACCOUNT}:repository/pdstack-{env}/{image}"
            for image in environment_images()  # what the control stack's registry makes (infra/registry.py)
        }
    return values
