"""What the policy rules read and say: the resource types they look at, the graph's resources, the pack's config,
violations, the rule records, and the property helpers the rules share. Standard library only (see __init__.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network, ip_network
from typing import Any

INSTANCE_TAGS = ("pdstack:env", "pdstack:dc", "pdstack:role", "pdstack:pool")
PURPOSE_TAG = "pdstack:purpose"
IMAGES_TAG = "pdstack:images"  # a GPU pool's instances: the repositories of the images they run, space-separated
GPU_ROLES = ("prefill", "decode")
# A bucket Ansible's aws_ssm connection moves module files through (infra/operator_access.py): never versioned, so
# no module's arguments outlive their run in its history.
TRANSFER_PURPOSE = "ansible-transfer"
PRIVATE_NETWORKS = tuple(IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
KV_WIDEST_PREFIX = 16

INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SECURITY_GROUP_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"
ROLE_POLICY = "aws:iam/rolePolicy:RolePolicy"
AUTOSCALING_GROUP = "aws:autoscaling/group:Group"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
BUCKET = "aws:s3/bucket:Bucket"
BUCKET_ENCRYPTION = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
BUCKET_PUBLIC_ACCESS = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
BUCKET_VERSIONING = "aws:s3/bucketVersioning:BucketVersioning"
EKS_CLUSTER = "aws:eks/cluster:Cluster"
EKS_ACCESS_POLICY = "aws:eks/accessPolicyAssociation:AccessPolicyAssociation"
EKS_ADDON = "aws:eks/addon:Addon"
KMS_KEY = "aws:kms/key:Key"
ZONE = "aws:route53/zone:Zone"
SECRET = "aws:secretsmanager/secret:Secret"  # noqa: S105 (a type name)
SUBNET = "aws:ec2/subnet:Subnet"
LAMBDA_FUNCTION = "aws:lambda/function:Function"
HPA = "kubernetes:autoscaling/v2:HorizontalPodAutoscaler"
STACK = "pulumi:pulumi:Stack"  # its props are the stack's outputs
# How a secret value travels in Pulumi's property maps (the SDK's rpc signature), as the stack's outputs carry one.
SECRET_SIGNATURE = ("4dabf18193072939515e22adb298388d", "1b47061264138c4ac30d75fd1eb44270")
# What losing loses data or access to it: protected, so that no destroy or replacement removes it unasked.
STATEFUL_TYPES = (KMS_KEY, ZONE, EKS_CLUSTER, BUCKET, SECRET)
K8S_SERVICE = "kubernetes:core/v1:Service"
K8S_INGRESS = "kubernetes:networking.k8s.io/v1:Ingress"
LB_LISTENERS = ("aws:lb/listener:Listener", "aws:alb/listener:Listener")
NLB_TLS_CERT = "service.beta.kubernetes.io/aws-load-balancer-ssl-cert"
NLB_TLS_PORTS = "service.beta.kubernetes.io/aws-load-balancer-ssl-ports"
NLB_TLS_POLICY = "service.beta.kubernetes.io/aws-load-balancer-ssl-negotiation-policy"
# A load balancer that passes TLS through to its pods, which end it themselves (infra/workloads/access.py)
TLS_PASSTHROUGH = "pdstack.io/tls-passthrough"
# ELB security policies that still negotiate TLS 1.0 or 1.1: a listener with one is not encrypted as we mean it
LEGACY_TLS_POLICIES = (
    "ELBSecurityPolicy-2016-08",
    "ELBSecurityPolicy-2015-05",
    "ELBSecurityPolicy-TLS-1-0-2015-04",
    "ELBSecurityPolicy-TLS-1-1-2017-01",
    "ELBSecurityPolicy-FS-2018-06",
    "ELBSecurityPolicy-FS-1-1-2019-08",
)
K8S_WORKLOADS = ("kubernetes:apps/v1:Deployment", "kubernetes:apps/v1:StatefulSet", "kubernetes:apps/v1:DaemonSet")


@dataclass(frozen=True)
class PolicyConfig:
    kv_port: int = 8400
    kv_port_last: int | None = None  # a vLLM prefill listens on one KV port per worker: kv_port..kv_port_last
    protect_stateful: bool = True  # false only for a dev stack with pdstack-infra:protect false

    @property
    def kv_ports(self) -> range:
        return range(self.kv_port, (self.kv_port if self.kv_port_last is None else self.kv_port_last) + 1)

    @classmethod
    def from_pack_config(cls, raw: Mapping[str, Any]) -> PolicyConfig:
        """From the pack's config for the KV rule (policy/config/<env>.json, pdstack.contract.files.policy_config)."""
        last = raw.get("kvPortLast")
        return cls(
            kv_port=int(raw.get("kvPort", cls.kv_port)),
            kv_port_last=None if last is None else int(last),
            protect_stateful=bool(raw.get("protectStateful", True)),
        )

    def describe_kv_ports(self) -> str:
        ports = self.kv_ports
        return f"KV port {ports[0]}" if len(ports) == 1 else f"KV ports {ports[0]}-{ports[-1]}"


@dataclass(frozen=True)
class PolicyResource:
    type: str
    name: str
    urn: str
    props: dict[str, Any]
    parent: str = ""  # the parent's URN: a component's resources are its children
    protect: bool = False  # the resource option: no destroy or replacement removes it unasked


@dataclass(frozen=True)
class Violation:
    policy: str
    resource: str  # the resource's name
    type: str
    message: str

    def __str__(self) -> str:
        return f"[{self.policy}] {self.type} {self.resource}: {self.message}"


ResourceCheck = Callable[[str, dict[str, Any], PolicyConfig], list[str]]
StackCheck = Callable[[list[PolicyResource], PolicyConfig], list[tuple[PolicyResource, str]]]


@dataclass(frozen=True)
class ResourceRule:
    name: str
    description: str
    check: ResourceCheck


@dataclass(frozen=True)
class StackRule:
    name: str
    description: str
    check: StackCheck


def get(props: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if not isinstance(props, dict) or part not in props:
            return default
        props = props[part]
    return props


def is_true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def network(cidr: Any) -> IPv4Network | None:
    try:
        net = ip_network(str(cidr), strict=False)
    except ValueError:
        return None
    return net if isinstance(net, IPv4Network) else None


def is_open(cidr: Any) -> bool:
    net = network(cidr)
    return (net is not None and net.prefixlen == 0) or str(cidr).endswith("::/0")
