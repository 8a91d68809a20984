"""The rules pdstack's infrastructure must obey: plain functions over (resource type, properties).

One set of rules, two uses: the policy pack (policy/__main__.py, through pack.py) registers them as mandatory
policies for `pulumi preview --policy-pack policy/`, and `pdstack synth` and the tests call them on the resource graph
the program builds under mocks. Properties are the engine's camelCase names. Standard library only: the pack's
virtualenv holds nothing but pulumi and pulumi-policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network, ip_network
from typing import Any

INSTANCE_TAGS = ("pdstack:env", "pdstack:dc", "pdstack:role", "pdstack:pool")
PURPOSE_TAG = "pdstack:purpose"
PRIVATE_NETWORKS = tuple(IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
KV_WIDEST_PREFIX = 16

INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"
SECURITY_GROUP_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INSTANCE = "aws:ec2/instance:Instance"
AUTOSCALING_GROUP = "aws:autoscaling/group:Group"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
BUCKET = "aws:s3/bucket:Bucket"
BUCKET_ENCRYPTION = "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration"
BUCKET_PUBLIC_ACCESS = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
BUCKET_VERSIONING = "aws:s3/bucketVersioning:BucketVersioning"
EKS_CLUSTER = "aws:eks/cluster:Cluster"
K8S_SERVICE = "kubernetes:core/v1:Service"
K8S_INGRESS = "kubernetes:networking.k8s.io/v1:Ingress"
LB_LISTENERS = ("aws:lb/listener:Listener", "aws:alb/listener:Listener")
NLB_TLS_CERT = "service.beta.kubernetes.io/aws-load-balancer-ssl-cert"
NLB_TLS_PORTS = "service.beta.kubernetes.io/aws-load-balancer-ssl-ports"
NLB_TLS_POLICY = "service.beta.kubernetes.io/aws-load-balancer-ssl-negotiation-policy"
# ELB security policies that still negotiate TLS 1.0 or 1.1: a listener with one is not encrypted as we mean it
LEGACY_TLS_POLICIES = ("ELBSecurityPolicy-2016-08", "ELBSecurityPolicy-2015-05", "ELBSecurityPolicy-TLS-1-0-2015-04",
                       "ELBSecurityPolicy-TLS-1-1-2017-01", "ELBSecurityPolicy-FS-2018-06",
                       "ELBSecurityPolicy-FS-1-1-2019-08")  # fmt: skip
K8S_WORKLOADS = ("kubernetes:apps/v1:Deployment", "kubernetes:apps/v1:StatefulSet", "kubernetes:apps/v1:DaemonSet")


@dataclass(frozen=True)
class PolicyConfig:
    kv_port: int = 8400
    kv_port_last: int | None = None  # a vLLM prefill listens on one KV port per worker: kv_port..kv_port_last

    @property
    def kv_ports(self) -> range:
        return range(self.kv_port, (self.kv_port if self.kv_port_last is None else self.kv_port_last) + 1)

    @classmethod
    def from_pack_config(cls, raw: Mapping[str, Any]) -> PolicyConfig:
        """From the pack's config for the KV rule (policy/config/<env>.json, pdstack.contract_files.policy_config)."""
        last = raw.get("kvPortLast")
        return cls(kv_port=int(raw.get("kvPort", cls.kv_port)), kv_port_last=None if last is None else int(last))

    def describe_kv_ports(self) -> str:
        ports = self.kv_ports
        return f"KV port {ports[0]}" if len(ports) == 1 else f"KV ports {ports[0]}-{ports[-1]}"


@dataclass(frozen=True)
class PolicyResource:
    type: str
    name: str
    urn: str
    props: dict[str, Any]


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


def _get(props: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if not isinstance(props, dict) or part not in props:
            return default
        props = props[part]
    return props


def _is_true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _network(cidr: Any) -> IPv4Network | None:
    try:
        net = ip_network(str(cidr), strict=False)
    except ValueError:
        return None
    return net if isinstance(net, IPv4Network) else None


def _is_open(cidr: Any) -> bool:
    net = _network(cidr)
    return (net is not None and net.prefixlen == 0) or str(cidr).endswith("::/0")


# --- no-open-ingress --------------------------------------------------------------------------------------------


def _ingress_cidrs(type_: str, props: dict[str, Any]) -> list[str]:
    """Every CIDR an ingress resource admits, whatever the resource flavour."""
    if type_ == INGRESS_RULE:
        return [c for c in (props.get("cidrIpv4"), props.get("cidrIpv6")) if c]
    if type_ == SECURITY_GROUP_RULE and props.get("type") == "ingress":
        return [*props.get("cidrBlocks", []), *props.get("ipv6CidrBlocks", [])]
    if type_ == SECURITY_GROUP:
        return [
            c
            for rule in props.get("ingress", []) or []
            for c in [*rule.get("cidrBlocks", []), *rule.get("ipv6CidrBlocks", [])]
        ]
    return []


def check_no_open_ingress(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    problems = [f"ingress from {c} opens it to the whole internet" for c in _ingress_cidrs(type_, props) if _is_open(c)]
    if type_ == K8S_SERVICE and _get(props, "spec.type") == "LoadBalancer":
        ranges = _get(props, "spec.loadBalancerSourceRanges") or []
        if not ranges or any(_is_open(c) for c in ranges):
            problems.append("a LoadBalancer Service needs loadBalancerSourceRanges, none of them 0.0.0.0/0")
        annotations = _get(props, "metadata.annotations") or {}
        if annotations.get("service.beta.kubernetes.io/aws-load-balancer-internal") != "true":
            problems.append('a LoadBalancer Service must be internal (aws-load-balancer-internal: "true")')
    if type_ == EKS_CLUSTER and _is_true(_get(props, "vpcConfig.endpointPublicAccess")):
        cidrs = _get(props, "vpcConfig.publicAccessCidrs") or []
        if not cidrs or any(_is_open(c) for c in cidrs):
            problems.append("the public API endpoint must be limited by publicAccessCidrs, never 0.0.0.0/0")
    return problems


# --- kv-port-peers-only -------------------------------------------------------------------------------------------


def _covers(props: dict[str, Any], ports: range) -> bool:
    """The rule opens at least one of `ports`."""
    if str(props.get("ipProtocol", props.get("protocol"))) in ("-1", "all"):
        return True
    low, high = props.get("fromPort"), props.get("toPort")
    # Numbers reach policies as JSON numbers: 8400 or 8400.0.
    return isinstance(low, int | float) and isinstance(high, int | float) and low <= ports[-1] and ports[0] <= high


def check_kv_port_peers_only(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    """The KV ports admit only the peer datacenters' private networks, through rules that say so."""
    problems = []
    if type_ == INGRESS_RULE:
        cidrs = _ingress_cidrs(type_, props)
        if not cidrs or not _covers(props, config.kv_ports):
            return []  # group-to-group rules (EFA within its own group) carry no address range
        purpose = (props.get("tags") or {}).get(PURPOSE_TAG)
        if purpose != "kv":
            problems.append(f"opens the {config.describe_kv_ports()} as part of a {purpose or 'untagged'} rule")
        for cidr in cidrs:
            net = _network(cidr)
            if net is None or not any(net.subnet_of(p) for p in PRIVATE_NETWORKS):
                problems.append(f"the KV port is open to {cidr}, which is not a private peer network")
            elif net.prefixlen < KV_WIDEST_PREFIX:
                problems.append(f"the KV port is open to {cidr}, wider than a datacenter (/{KV_WIDEST_PREFIX})")
    elif type_ in (SECURITY_GROUP, SECURITY_GROUP_RULE):
        rules = (
            props.get("ingress", []) if type_ == SECURITY_GROUP else [props] if props.get("type") == "ingress" else []
        )
        if any(_covers(r, config.kv_ports) and (r.get("cidrBlocks") or r.get("ipv6CidrBlocks")) for r in rules):
            problems.append("the KV port may only be opened by a tagged SecurityGroupIngressRule per peer network")
    return problems


# --- encryption-at-rest -------------------------------------------------------------------------------------------


def _launch_template_volumes(props: dict[str, Any]) -> list[str]:
    problems = []
    for mapping in props.get("blockDeviceMappings", []) or []:
        ebs = mapping.get("ebs") or {}
        device = mapping.get("deviceName", "?")
        if not _is_true(ebs.get("encrypted")):
            problems.append(f"volume {device} is not encrypted")
        elif not ebs.get("kmsKeyId"):
            problems.append(f"volume {device} is encrypted with the AWS-managed key, not the datacenter's KMS key")
    return problems


def check_encryption_at_rest(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    if type_ == LAUNCH_TEMPLATE:
        return _launch_template_volumes(props)
    checks: dict[str, tuple[bool, str]] = {
        "aws:ebs/volume:Volume": (_is_true(props.get("encrypted")), "the volume is not encrypted"),
        "aws:kms/key:Key": (_is_true(props.get("enableKeyRotation")), "the KMS key does not rotate"),
        "aws:secretsmanager/secret:Secret": (
            bool(props.get("kmsKeyId")),
            "the secret is not under the environment's KMS key",
        ),
        "aws:fsx/lustreFileSystem:LustreFileSystem": (
            bool(props.get("kmsKeyId")),
            "the file system is not under a KMS key",
        ),
        EKS_CLUSTER: (
            "secrets" in (_get(props, "encryptionConfig.resources") or []),
            "Kubernetes Secrets are not envelope-encrypted with KMS",
        ),
        "aws:ecr/repository:Repository": (
            any(c.get("encryptionType") == "KMS" for c in props.get("encryptionConfigurations", []) or []),
            "images are not encrypted with KMS",
        ),
        BUCKET_ENCRYPTION: (
            all(
                str(_get(r, "applyServerSideEncryptionByDefault.sseAlgorithm", "")).startswith("aws:kms")
                for r in props.get("rules", []) or [{}]
            ),
            "the bucket's default encryption is not SSE-KMS",
        ),
    }
    if type_ == "kubernetes:storage.k8s.io/v1:StorageClass" and props.get("provisioner") == "ebs.csi.aws.com":
        checks[type_] = (_is_true(_get(props, "parameters.encrypted")), "volumes of this class are not encrypted")
    ok, message = checks.get(type_, (True, ""))
    return [] if ok else [message]


def check_buckets_protected(resources: list[PolicyResource], config: PolicyConfig) -> list[tuple[PolicyResource, str]]:
    """Every bucket has SSE-KMS default encryption, versioning, and all four public-access blocks."""

    def named(type_: str) -> dict[Any, PolicyResource]:
        return {r.props.get("bucket"): r for r in resources if r.type == type_}

    encryption, versioning, blocks = named(BUCKET_ENCRYPTION), named(BUCKET_VERSIONING), named(BUCKET_PUBLIC_ACCESS)
    problems = []
    for bucket in (r for r in resources if r.type == BUCKET):
        name = bucket.props.get("bucket")
        if name not in encryption:
            problems.append((bucket, "no default server-side encryption configuration"))
        versioned = versioning.get(name)
        status = _get(versioned.props, "versioningConfiguration.status") if versioned is not None else None
        if status != "Enabled":
            problems.append((bucket, "versioning is not enabled"))
        block = blocks.get(name)
        flags = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
        if block is None or not all(_is_true(block.props.get(f)) for f in flags):
            problems.append((bucket, "public access is not blocked on all four counts"))
    return problems


# --- imdsv2-required ----------------------------------------------------------------------------------------------


def check_imdsv2(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    if type_ in (LAUNCH_TEMPLATE, INSTANCE) and _get(props, "metadataOptions.httpTokens") != "required":
        return ["instance metadata must require IMDSv2 tokens (metadataOptions.httpTokens: required)"]
    return []


# --- efa-cluster-placement ----------------------------------------------------------------------------------------


def _uses_efa(template: PolicyResource) -> bool:
    return any(i.get("interfaceType") in ("efa", "efa-only") for i in template.props.get("networkInterfaces", []) or [])


def check_efa_cluster_placement(
    resources: list[PolicyResource], config: PolicyConfig
) -> list[tuple[PolicyResource, str]]:
    strategies = {
        r.props.get("name") or r.name: r.props.get("strategy") for r in resources if r.type == PLACEMENT_GROUP
    }
    problems = []
    for template in (r for r in resources if r.type == LAUNCH_TEMPLATE and _uses_efa(r)):
        group = _get(template.props, "placement.groupName")
        if group is None:
            problems.append((template, "EFA interfaces without a placement group"))
        elif strategies.get(group) != "cluster":
            problems.append((template, f"EFA needs a cluster placement group, {group!r} is {strategies.get(group)!r}"))
    return problems


# --- instance-tags ------------------------------------------------------------------------------------------------


def _missing(tags: dict[str, Any]) -> list[str]:
    return [k for k in INSTANCE_TAGS if not tags.get(k)]


def check_instance_tags(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    if type_ == LAUNCH_TEMPLATE:
        specs = [s for s in props.get("tagSpecifications", []) or [] if s.get("resourceType") == "instance"]
        missing = _missing(specs[0].get("tags") or {}) if specs else list(INSTANCE_TAGS)
        return [f"instances launched from it lack tags {', '.join(missing)}"] if missing else []
    if type_ == AUTOSCALING_GROUP:
        tags = {t.get("key"): t.get("value") for t in props.get("tags", []) or [] if t.get("propagateAtLaunch")}
        missing = _missing(tags)
        return [f"the group does not propagate tags {', '.join(missing)} to instances"] if missing else []
    return []


# --- probes-distinct ----------------------------------------------------------------------------------------------


def check_probes(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    if type_ not in K8S_WORKLOADS:
        return []
    problems = []
    for container in _get(props, "spec.template.spec.containers") or []:
        name = container.get("name", "?")
        liveness, readiness = container.get("livenessProbe"), container.get("readinessProbe")
        if not liveness or not readiness:
            problems.append(f"container {name} needs both a liveness and a readiness probe")
        elif liveness == readiness:
            problems.append(
                f"container {name} uses one probe for liveness and readiness; they answer different questions"
            )
        requests = _get(container, "resources.requests") or {}
        if not requests.get("cpu") or not requests.get("memory"):
            problems.append(f"container {name} has no cpu and memory requests")
    return problems


# --- tls-listeners ------------------------------------------------------------------------------------------------


def _modern_policy(policy: Any) -> bool:
    return bool(policy) and str(policy) not in LEGACY_TLS_POLICIES


def _service_tls(props: dict[str, Any]) -> list[str]:
    """A load-balanced Service listens with TLS on every port: a certificate, the ports it covers, TLS 1.2+."""
    annotations = _get(props, "metadata.annotations") or {}
    if not annotations.get(NLB_TLS_CERT):
        return [f"a {_get(props, 'spec.type')} Service must listen with TLS ({NLB_TLS_CERT})"]
    covered = {p.strip() for p in str(annotations.get(NLB_TLS_PORTS, "*")).split(",")}
    problems = [
        f"port {port.get('port')} listens without TLS (not in {NLB_TLS_PORTS})"
        for port in _get(props, "spec.ports") or []
        if "*" not in covered and not {str(port.get("port")), str(port.get("name"))} & covered
    ]
    if not _modern_policy(annotations.get(NLB_TLS_POLICY)):
        problems.append(f"{NLB_TLS_POLICY} must name a policy without TLS 1.0/1.1")
    return problems


def _listener_tls(props: dict[str, Any]) -> list[str]:
    protocol = str(props.get("protocol", "")).upper()
    if protocol == "HTTP":
        actions = props.get("defaultActions") or []
        redirects = all(
            a.get("type") == "redirect" and str(_get(a, "redirect.protocol", "")).upper() == "HTTPS" for a in actions
        )
        return [] if actions and redirects else ["an HTTP listener may only redirect to HTTPS"]
    if protocol not in ("HTTPS", "TLS"):
        return [f"a {protocol or 'TCP'} listener carries plaintext: listen with TLS or HTTPS"]
    problems = [] if props.get("certificateArn") else ["a TLS listener needs a certificate"]
    if not _modern_policy(props.get("sslPolicy")):
        problems.append("the listener's sslPolicy must not allow TLS 1.0/1.1")
    return problems


def check_tls_listeners(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    """Everything that listens beyond the cluster does so with TLS: load balancers made from Services, ELB
    listeners (HTTP only to redirect), Ingresses."""
    if type_ == K8S_SERVICE and _get(props, "spec.type") in ("LoadBalancer", "NodePort"):
        return _service_tls(props)
    if type_ in LB_LISTENERS:
        return _listener_tls(props)
    if type_ == K8S_INGRESS:
        hosts = {h for rule in _get(props, "spec.rules") or [] if (h := rule.get("host"))}
        covered = {h for t in _get(props, "spec.tls") or [] for h in t.get("hosts") or []}
        if not _get(props, "spec.tls") or not hosts <= covered:
            return ["an Ingress must serve TLS for every host (spec.tls)"]
    return []


RESOURCE_RULES = (
    ResourceRule(
        "no-open-ingress",
        "Nothing admits 0.0.0.0/0: security groups, load balancers, API endpoints.",
        check_no_open_ingress,
    ),
    ResourceRule(
        "kv-port-peers-only",
        "The KV channel port admits only peer datacenters' private networks.",
        check_kv_port_peers_only,
    ),
    ResourceRule(
        "encryption-at-rest",
        "Volumes, buckets, secrets, images, file systems and keys are KMS-encrypted.",
        check_encryption_at_rest,
    ),
    ResourceRule("imdsv2-required", "Instances require IMDSv2 session tokens.", check_imdsv2),
    ResourceRule(
        "instance-tags",
        "Every instance carries pdstack:env, pdstack:dc, pdstack:role and pdstack:pool.",
        check_instance_tags,
    ),
    ResourceRule(
        "tls-listeners",
        "Load balancers, their listeners and Ingresses listen with TLS 1.2+ (plain HTTP only to redirect).",
        check_tls_listeners,
    ),
    ResourceRule(
        "probes-distinct", "Workloads have distinct liveness and readiness probes and resource requests.", check_probes
    ),
)
STACK_RULES = (
    StackRule(
        "s3-buckets-protected", "Buckets are SSE-KMS encrypted, versioned and never public.", check_buckets_protected
    ),
    StackRule(
        "efa-cluster-placement",
        "EFA launch templates place instances in a cluster placement group.",
        check_efa_cluster_placement,
    ),
)
POLICY_NAMES = tuple(r.name for r in RESOURCE_RULES) + tuple(r.name for r in STACK_RULES)


def evaluate(resources: Iterable[PolicyResource], config: PolicyConfig | None = None) -> list[Violation]:
    """Run every rule over a resource graph, as the policy pack would during `pulumi preview`."""
    config = config or PolicyConfig()
    graph = list(resources)
    found = [
        Violation(rule.name, r.name, r.type, message)
        for r in graph
        for rule in RESOURCE_RULES
        for message in rule.check(r.type, r.props, config)
    ]
    found += [
        Violation(rule.name, r.name, r.type, message)
        for rule in STACK_RULES
        for r, message in rule.check(graph, config)
    ]
    return found
