"""What `pdstack synth` prints of a synthesis (pdstack.synth.synthesis runs the program): each resource with its key
properties, the outputs with secrets redacted and the policy verdicts, as text or JSON; and the command itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdstack.stacks.environment import stack_files
from pdstack.stacks.files import StackFileError
from pdstack.synth.synthesis import REDACTED, Resource, SynthError, Synthesis, stack_path, synthesize

KEY_PROPS = {
    "aws:ec2/vpc:Vpc": ("cidrBlock",),
    "aws:ec2/subnet:Subnet": ("cidrBlock", "tags.pdstack:tier"),
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": (
        "tags.pdstack:purpose",
        "ipProtocol",
        "fromPort",
        "toPort",
        "cidrIpv4",
    ),
    "aws:ec2/launchTemplate:LaunchTemplate": (
        "instanceType",
        "imageId",
        "metadataOptions.httpTokens",
        "placement.groupName",
        "tags.pdstack:images",
    ),
    "aws:autoscaling/group:Group": ("name", "minSize", "desiredCapacity", "maxSize", "waitForCapacityTimeout"),
    "aws:autoscaling/lifecycleHook:LifecycleHook": ("name", "lifecycleTransition", "heartbeatTimeout", "defaultResult"),
    "aws:ec2/placementGroup:PlacementGroup": ("strategy",),
    "aws:s3/bucket:Bucket": ("bucket",),
    "aws:kms/key:Key": ("enableKeyRotation",),
    "aws:secretsmanager/secret:Secret": ("name",),
    "aws:ec2/vpcPeeringConnection:VpcPeeringConnection": ("peerRegion",),
    "aws:ec2transitgateway/peeringAttachment:PeeringAttachment": ("peerRegion",),
    "aws:ec2/route:Route": ("destinationCidrBlock", "region"),
    "aws:eks/cluster:Cluster": ("name", "version", "vpcConfig.endpointPublicAccess"),
    "aws:eks/nodeGroup:NodeGroup": ("instanceTypes", "scalingConfig"),
    "kubernetes:apps/v1:Deployment": ("metadata.name", "spec.replicas"),
    "kubernetes:core/v1:Service": ("metadata.name", "spec.type", "spec.loadBalancerSourceRanges"),
}


def key_properties(resource: Resource) -> dict[str, Any]:
    found = {}
    for path in KEY_PROPS.get(resource.type, ()):
        if path.startswith("tags."):  # tag keys hold a colon and no dots: look them up whole
            value = (resource.inputs.get("tags") or {}).get(path.removeprefix("tags."))
        else:
            value = resource.prop(path)
        if value is not None:
            found[path] = value
    if resource.type == "aws:ec2/launchTemplate:LaunchTemplate":
        kinds = [i.get("interfaceType") for i in resource.inputs.get("networkInterfaces", [])]
        found["efaInterfaces"] = sum(k in ("efa", "efa-only") for k in kinds)
    return found


def _redacted(value: Any, secret: bool) -> Any:
    return REDACTED if secret else value


def as_json(result: Synthesis) -> dict[str, Any]:
    return {
        "stack": result.stack,
        "skipped": result.skipped,
        "resources": [
            {
                "type": r.type,
                "name": r.name,
                "parent": r.parent,
                "key": key_properties(r),
                "inputs": {k: _redacted(v, k in r.secret_inputs) for k, v in r.inputs.items()},
            }
            for r in result.resources
        ],
        "outputs": {k: _redacted(v, k in result.secret_outputs) for k, v in result.outputs.items()},
        "violations": [
            {"policy": v.policy, "resource": v.resource, "type": v.type, "message": v.message}
            for v in result.violations
        ],
    }


def as_text(result: Synthesis) -> str:
    if result.skipped:
        return f"{result.stack}: nothing to synthesise: {result.skipped}"
    lines = [f"{result.stack}: {len(result.resources)} resources"]
    for r in result.resources:
        key = ", ".join(f"{k}={v}" for k, v in key_properties(r).items())
        lines.append(f"  {r.type:<70} {r.name}" + (f"  [{key}]" if key else ""))
    secret = ", ".join(sorted(result.secret_outputs)) or "none"
    lines.append(f"  outputs: {', '.join(sorted(result.outputs))} (secret: {secret})")
    if result.violations:
        lines += [f"  VIOLATION {v}" for v in result.violations]
    else:
        lines.append(f"  policies: all {result.policies_checked} passed")
    return "\n".join(lines)


def run_command(stacks_dir: Path, names: list[str], json_output: bool, env: str | None = None) -> tuple[str, int]:
    """Synthesise the named stacks (else those of `env`, else all of stacks_dir); exit status 1 on any violation
    or refusal."""
    paths = [stack_path(stacks_dir, n) for n in names] if names else stack_files(stacks_dir, env)
    if env is not None:
        outside = [p.name for p in paths if p not in stack_files(stacks_dir, env)]
        if outside:
            raise SynthError(f"not stacks of environment {env}: {', '.join(outside)}")
        if not paths:
            raise SynthError(f"no stack files Pulumi.{env}-*.yaml in {stacks_dir}")
    results, errors = [], []
    for path in paths:
        try:
            results.append(synthesize(path))
        except (SynthError, StackFileError) as exc:
            errors.append(str(exc))
    failed = bool(errors) or any(r.violations for r in results)
    if json_output:
        text = json.dumps({"stacks": [as_json(r) for r in results], "errors": errors}, indent=2, default=str)
    else:
        text = "\n".join([*(as_text(r) for r in results), *(f"error: {e}" for e in errors)])
    return text, 1 if failed else 0
