"""A GPU node pool: launch template on the stack's pinned node image (Debian 12), IMDSv2, encrypted volumes, EFA
interfaces in a cluster placement group when the instance type has them, an Auto Scaling group that `pulumi up`
waits for, and a least-privilege role."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from pdstack.contract.node_lifecycle import (
    DRAIN_DEFAULT_RESULT,
    DRAIN_HOOK,
    DRAIN_TRANSITION,
    NODE_READABLE_PREFIXES,
)
from pdstack.model import NodePool

# The node image is pinned per stack (pdstack-infra:node_image): an AMI id, or an SSM parameter that names one image
# forever, such as Debian's per-version public parameter /aws/service/debian/release/12/<version>/amd64 (Debian
# publishes one per image version beside `latest`, and never rewrites it). Never a `latest`-style parameter: every
# instance the group replaces or adds would boot whatever image is newest that day.
AMI_ID = re.compile(r"^ami-[0-9a-f]{8,17}$")
SSM_PARAMETER = re.compile(r"^(/[A-Za-z0-9_.-]+)+(:[1-9][0-9]*)?$")
MOVING_SEGMENTS = frozenset({"latest", "current", "recommended", "stable-latest"})
# Debian's official images register their root volume as /dev/xvda (debian-cloud-images, upload_ec2.py): the
# mapping must name it to size the root volume rather than attach a second one.
ROOT_DEVICE, DATA_DEVICE = "/dev/xvda", "/dev/sdb"
ROOT_VOLUME_GIB = 200


def node_image_problem(image: str) -> str | None:
    """Why `image` does not pin one node image, or None: an AMI id, or an SSM parameter path (optionally with a
    `:version` selector) none of whose segments moves (`latest`, `current`, ...)."""
    if AMI_ID.match(image):
        return None
    if not SSM_PARAMETER.match(image):
        return (
            f"{image!r} is neither an AMI id (ami- and 8 to 17 hex digits) nor an SSM parameter path such as "
            "/aws/service/debian/release/12/<version>/amd64"
        )
    moving = sorted(MOVING_SEGMENTS & set(image.split(":", 1)[0].strip("/").split("/")))
    if moving:
        return (
            f"{image!r} names a parameter that moves ({', '.join(moving)}): each replacement would boot a different "
            "image; name the version (Debian: /aws/service/debian/release/12/<version>/amd64) or an AMI id"
        )
    return None


def node_image_id(image: str, opts: pulumi.InvokeOutputOptions) -> pulumi.Input[str]:
    """The AMI the pinned `image` names: itself, or the value of its SSM parameter resolved at `pulumi up`."""
    if AMI_ID.match(image):
        return image
    return aws.ssm.get_parameter_output(name=image, opts=opts).value


# Network cards carrying EFA per instance type (EC2 User Guide, "Network cards"); one EFA interface per card
# reaches the type's full bandwidth. Types not listed get one.
EFA_NETWORK_CARDS = {
    "p4d.24xlarge": 4,
    "p4de.24xlarge": 4,
    "p5.48xlarge": 32,
    "p5e.48xlarge": 32,
    "p5en.48xlarge": 16,
    "p6-b200.48xlarge": 8,
    "g6e.24xlarge": 2,
    "g6e.48xlarge": 4,
}


def network_interfaces(
    efa: bool, instance_type: str, security_group_id: pulumi.Input[str]
) -> list[aws.ec2.LaunchTemplateNetworkInterfaceArgs]:
    """Card 0 carries the primary ENA+EFA interface; further cards carry EFA-only interfaces (no IP address).

    EC2 refuses AssociatePublicIpAddress when a launch specifies more than one interface, so a multi-interface
    template leaves it unset: the nodes' subnets are private (infra/network.py) and give no public address anyway.
    A single-interface template says `false` outright. Policy `launch-template-interfaces` refuses the field on a
    template with several interfaces."""
    cards = EFA_NETWORK_CARDS.get(instance_type, 1) if efa else 1
    public_ip = "false" if cards == 1 else None
    if not efa:
        return [
            aws.ec2.LaunchTemplateNetworkInterfaceArgs(
                device_index=0,
                security_groups=[security_group_id],
                associate_public_ip_address=public_ip,
                delete_on_termination="true",
            )
        ]
    return [
        aws.ec2.LaunchTemplateNetworkInterfaceArgs(
            device_index=0 if card == 0 else 1,
            network_card_index=card,
            interface_type="efa" if card == 0 else "efa-only",
            security_groups=[security_group_id],
            associate_public_ip_address=public_ip,
            delete_on_termination="true",
        )
        for card in range(cards)
    ]


@dataclass(frozen=True)
class GpuNodePoolArgs:
    pool: NodePool
    efa: bool
    subnet_ids: Sequence[pulumi.Input[str]]  # one per zone; a cluster placement group uses the first only
    security_group_id: pulumi.Input[str]
    volume_key_arn: pulumi.Input[str]
    readable_secret_arns: Sequence[pulumi.Input[str]]
    secrets_key_arn: pulumi.Input[str]
    secrets_region: str
    model_bucket_arn: pulumi.Input[str]
    repository_arns: Sequence[pulumi.Input[str]]
    release_parameter_arn: pulumi.Input[str]  # the environment's release record (SSM, the control plane's region)
    scheduler_url_parameter_arn: pulumi.Input[str]  # the scheduler's URL (SSM, likewise): what a node joins
    account_id: pulumi.Input[str]  # this datacenter's account: its group's ARN
    group_name: str  # pdstack.contract.node_lifecycle.node_group_name: fixed, so the role can name it before it exists
    role_name: str  # pdstack.contract.node_lifecycle.node_role_name: fixed, the scheduler's join_node_roles names it
    region: str  # the datacenter's: its group's and its model bucket's
    # How long a node chosen for scale-in may drain before its group terminates it anyway
    # (pdstack.contract.node_lifecycle.drain_timeout_seconds of the environment's serving block)
    drain_timeout_seconds: int
    instance_tags: Mapping[str, str]
    node_image: str  # pdstack-infra:node_image: an AMI id or a pinned SSM parameter (node_image_problem)
    # The `#cloud-config` (base64) a fresh instance boots from to a serving node: pdstack/node/userdata.py's rendering
    # for this pool (infra/program.py), the same document the local environment's nodes boot with.
    user_data: str
    capacity_wait_minutes: int = 30  # pdstack-infra:capacity_wait_minutes (infra/environment.py)
    ssh_key_name: str | None = None


class GpuNodePool(pulumi.ComponentResource):
    group: aws.autoscaling.Group
    launch_template: aws.ec2.LaunchTemplate
    role_policy: aws.iam.RolePolicy
    drain_hook: aws.autoscaling.LifecycleHook
    placement_group: aws.ec2.PlacementGroup | None = None

    def __init__(self, name: str, args: GpuNodePoolArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:nodes:GpuNodePool", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.instance_tags)
        profile = self._instance_profile(name, args, child)
        strategy = "cluster" if args.efa else args.pool.placement.value  # EFA is only worth it packed together
        if strategy != "none":
            self.placement_group = aws.ec2.PlacementGroup(
                f"{name}-placement",
                strategy=strategy,
                tags=tags,
                opts=child,
            )
        self.launch_template = aws.ec2.LaunchTemplate(
            f"{name}-template",
            image_id=node_image_id(args.node_image, pulumi.InvokeOutputOptions(parent=self)),
            instance_type=args.pool.instance_type,
            key_name=args.ssh_key_name,
            user_data=args.user_data,
            iam_instance_profile=aws.ec2.LaunchTemplateIamInstanceProfileArgs(arn=profile.arn),
            ebs_optimized="true",
            metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(
                http_endpoint="enabled",
                http_tokens="required",  # IMDSv2 only
                http_put_response_hop_limit=1,  # containers cannot reach the node's credentials
                # off: a node knows who it is from node.json (its user data) and its instance id from cloud-init;
                # nothing on it reads tags from the metadata service
                instance_metadata_tags="disabled",
            ),
            block_device_mappings=[
                _volume(device, size, args.volume_key_arn)
                for device, size in ((ROOT_DEVICE, ROOT_VOLUME_GIB), (DATA_DEVICE, args.pool.data_volume_gib))
                if size > 0
            ],
            network_interfaces=network_interfaces(args.efa, args.pool.instance_type, args.security_group_id),
            placement=aws.ec2.LaunchTemplatePlacementArgs(group_name=self.placement_group.name)
            if self.placement_group
            else None,
            tag_specifications=[
                aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=tags)
                for kind in ("instance", "volume", "network-interface")
            ],
            update_default_version=True,
            tags=tags,
            opts=child,
        )
        single_zone = strategy == "cluster"  # a cluster placement group lives in one zone
        self.group = aws.autoscaling.Group(
            f"{name}-group",
            name=args.group_name,
            min_size=args.pool.min_size,
            desired_capacity=args.pool.desired_size,
            max_size=args.pool.max_size,
            vpc_zone_identifiers=list(args.subnet_ids[:1] if single_zone else args.subnet_ids),
            launch_template=aws.autoscaling.GroupLaunchTemplateArgs(
                id=self.launch_template.id, version=self.launch_template.latest_version.apply(str)
            ),
            health_check_type="EC2",
            health_check_grace_period=900,  # driver load and weight download before the node counts as unhealthy
            # `pulumi up` succeeds only once the group's desired instances are InService and healthy (EC2 health
            # checks: running, status checks passing), and fails when they do not come within the stack's
            # pdstack-infra:capacity_wait_minutes or a launch fails (InsufficientInstanceCapacity, a refused
            # template): GPU capacity is scarce, and an update that reports success with no instance hides it. What
            # InService proves is an instance, not a serving engine: that is the bootstrap's (user data) to report.
            wait_for_capacity_timeout=f"{args.capacity_wait_minutes}m",
            tags=[aws.autoscaling.GroupTagArgs(key=k, value=v, propagate_at_launch=True) for k, v in tags.items()],
            # the first instances boot into their bootstrap at once: their role must already allow it
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.role_policy]),
        )
        # Scale-in is a drain: an instance the group chooses to terminate waits (Terminating:Wait) until its node has
        # deregistered, finished its requests and ended its KV leases and completes this hook, or until the timeout,
        # after which the group terminates it anyway (CONTINUE: a dead node still leaves). The node side uses the
        # names in pdstack.contract.node_lifecycle.
        self.drain_hook = aws.autoscaling.LifecycleHook(
            f"{name}-drain",
            name=DRAIN_HOOK,
            autoscaling_group_name=args.group_name,  # known at preview, for the policy pack
            lifecycle_transition=DRAIN_TRANSITION,
            heartbeat_timeout=args.drain_timeout_seconds,
            default_result=DRAIN_DEFAULT_RESULT,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.group]),
        )
        self.register_outputs({"group_name": self.group.name, "launch_template_id": self.launch_template.id})

    def _instance_profile(
        self, name: str, args: GpuNodePoolArgs, opts: pulumi.ResourceOptions
    ) -> aws.iam.InstanceProfile:
        role = aws.iam.Role(
            f"{name}-node",
            name=args.role_name,
            assume_role_policy=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [
                        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}
                    ],
                }
            ),
            tags=dict(args.instance_tags),
            opts=opts,
        )
        self.role_policy = aws.iam.RolePolicy(
            f"{name}-node",
            role=role.id,
            policy=pulumi.Output.all(
                secrets=list(args.readable_secret_arns),
                secrets_key=args.secrets_key_arn,
                bucket=args.model_bucket_arn,
                volume_key=args.volume_key_arn,
                repositories=list(args.repository_arns),
                release=args.release_parameter_arn,
                scheduler_url=args.scheduler_url_parameter_arn,
                account=args.account_id,
            ).apply(
                lambda a: node_policy(
                    {**a, "group": group_arn(args.region, a["account"], args.group_name)},
                    secrets_region=args.secrets_region,
                    region=args.region,
                )
            ),
            opts=opts,
        )
        return aws.iam.InstanceProfile(f"{name}-node", role=role.name, tags=dict(args.instance_tags), opts=opts)


def group_arn(region: str, account: str, group_name: str) -> str:
    """An Auto Scaling group's ARN by its name (the group's id in the ARN is not known before it exists)."""
    return f"arn:aws:autoscaling:{region}:{account}:autoScalingGroup:*:autoScalingGroupName/{group_name}"


def parameter_arn(region: str, account: str, name: str) -> str:
    """An SSM parameter's ARN; a hierarchical name (/a/b) keeps its leading slash after `parameter`."""
    return f"arn:aws:ssm:{region}:{account}:parameter{name if name.startswith('/') else '/' + name}"


# Session Manager's own calls from the agent (AWS's minimal instance permissions for Session Manager), in place of
# AmazonSSMManagedInstanceCore, which also allows ssm:GetParameter(s) on every parameter of the account
SESSION_ACTIONS = (
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
)
LIFECYCLE_ACTIONS = (
    "autoscaling:SetInstanceHealth",  # a failed bootstrap: Unhealthy, the group replaces it
    "autoscaling:RecordLifecycleActionHeartbeat",  # a drain that needs longer than the hook's timeout
    "autoscaling:CompleteLifecycleAction",  # a drain done: the group may terminate it
)


def node_policy(arns: dict[str, Any], secrets_region: str, region: str) -> str:
    """What a node's bootstrap and drain call (docs/node-bootstrap.md), each on exactly its resource: the release
    record and the scheduler's URL; the node secrets and its pool's certificate; ECR's token and its images; the
    release's objects in its datacenter's model bucket; its own group's health and lifecycle actions. And the SSM
    agent's session channel, the operators' way in. Nothing else."""
    statements = [
        {"Sid": "ReadRelease", "Effect": "Allow", "Action": "ssm:GetParameter", "Resource": arns["release"]},
        # the scheduler's URL: the bootstrap joins it (phase join), the node's play heartbeats to it
        {"Sid": "ReadSchedulerUrl", "Effect": "Allow", "Action": "ssm:GetParameter", "Resource": arns["scheduler_url"]},
        {
            "Sid": "ReadNodeSecrets",
            "Effect": "Allow",
            "Action": "secretsmanager:GetSecretValue",
            "Resource": arns["secrets"],
        },
        {
            "Sid": "DecryptSecrets",
            "Effect": "Allow",
            "Action": "kms:Decrypt",
            "Resource": arns["secrets_key"],
            "Condition": {"StringEquals": {"kms:ViaService": f"secretsmanager.{secrets_region}.amazonaws.com"}},
        },
        {"Sid": "EcrLogin", "Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"},
        {
            "Sid": "PullImages",
            "Effect": "Allow",
            "Action": ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
            "Resource": arns["repositories"],
        },
        {
            # GET and HEAD (boto3's download_file) of the model's files and the bundle; the bootstrap never lists
            "Sid": "ReadReleaseObjects",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [f"{arns['bucket']}/{prefix}*" for prefix in NODE_READABLE_PREFIXES],
        },
        {
            "Sid": "DecryptReleaseObjects",
            "Effect": "Allow",
            "Action": "kms:Decrypt",
            "Resource": arns["volume_key"],
            "Condition": {"StringEquals": {"kms:ViaService": f"s3.{region}.amazonaws.com"}},
        },
        {"Sid": "OwnGroupLifecycle", "Effect": "Allow", "Action": list(LIFECYCLE_ACTIONS), "Resource": arns["group"]},
        {"Sid": "SessionManager", "Effect": "Allow", "Action": list(SESSION_ACTIONS), "Resource": "*"},
    ]
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def _volume(device: str, size_gib: int, key_arn: pulumi.Input[str]) -> aws.ec2.LaunchTemplateBlockDeviceMappingArgs:
    return aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
        device_name=device,
        ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
            volume_size=size_gib,
            volume_type="gp3",
            iops=16000,  # gp3's ceiling: weights load from here after the first download
            throughput=1000,
            encrypted="true",
            kms_key_id=key_arn,
            delete_on_termination="true",
        ),
    )
