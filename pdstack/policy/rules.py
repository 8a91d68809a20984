"""The rules pdstack's infrastructure must obey: plain functions over (resource type, properties).

One set of rules, two uses: the policy pack (policy/__main__.py, through pack.py) registers them as mandatory
policies for `pulumi preview --policy-pack policy/`, and `pdstack synth` and the tests call them on the resource graph
the program builds under mocks. Properties are the engine's camelCase names. Standard library only: the pack's
virtualenv holds nothing but pulumi and pulumi-policy. The network rules are in network_rules.py, what they all read
in core.py; here the hardening rules, the registry of every rule, and `evaluate`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable
from typing import Any

from pdstack.policy.core import (
    AUTOSCALING_GROUP,
    BUCKET,
    BUCKET_ENCRYPTION,
    BUCKET_PUBLIC_ACCESS,
    BUCKET_VERSIONING,
    EKS_ACCESS_POLICY,
    EKS_ADDON,
    EKS_CLUSTER,
    GPU_ROLES,
    HPA,
    IMAGES_TAG,
    INSTANCE,
    INSTANCE_TAGS,
    K8S_SERVICE,
    K8S_WORKLOADS,
    LAMBDA_FUNCTION,
    LAUNCH_TEMPLATE,
    PLACEMENT_GROUP,
    PURPOSE_TAG,
    ROLE_POLICY,
    SECRET_SIGNATURE,
    STACK,
    STATEFUL_TYPES,
    SUBNET,
    TRANSFER_PURPOSE,
    PolicyConfig,
    PolicyResource,
    ResourceRule,
    StackRule,
    Violation,
    get,
    is_true,
)
from pdstack.policy.network_rules import check_kv_port_peers_only, check_no_open_ingress, check_tls_listeners

# --- control plane: protection, outputs, reachability, load balancers, metrics --------------------------------------

CLUSTER_ADMIN_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"
READ_ONLY_POLICIES = (
    "arn:aws:eks::aws:cluster-access-policy/AmazonEKSAdminViewPolicy",
    "arn:aws:eks::aws:cluster-access-policy/AmazonEKSViewPolicy",
)
ACCESS_ENTRY_MODES = ("API", "API_AND_CONFIG_MAP")
INTERNAL_ELB = "kubernetes.io/role/internal-elb"
PUBLIC_ELB = "kubernetes.io/role/elb"
LB_INTERNAL_ANNOTATIONS = (
    "service.beta.kubernetes.io/aws-load-balancer-internal",
    "service.beta.kubernetes.io/aws-load-balancer-scheme",
)


def check_stateful_protected(resources: list[PolicyResource], config: PolicyConfig) -> list[tuple[PolicyResource, str]]:
    if not config.protect_stateful:
        return []
    return [
        (r, "a stateful resource is not protected (protect=True): a destroy or replacement would remove it")
        for r in resources
        if r.type in STATEFUL_TYPES and not r.protect
    ]


def _is_secret(value: Any) -> bool:
    return isinstance(value, dict) and value.get(SECRET_SIGNATURE[0]) == SECRET_SIGNATURE[1]


def check_no_secret_outputs(resources: list[PolicyResource], config: PolicyConfig) -> list[tuple[PolicyResource, str]]:
    return [
        (r, f"stack output {key!r} holds a secret value")
        for r in resources
        if r.type == STACK
        for key, value in sorted(r.props.items())
        if _is_secret(value)
    ]


def _cluster_reachability(cluster: PolicyResource) -> list[str]:
    problems = []
    if get(cluster.props, "accessConfig.authenticationMode") not in ACCESS_ENTRY_MODES:
        problems.append("authentication mode is not API or API_AND_CONFIG_MAP: access entries are not used")
    vpc = cluster.props.get("vpcConfig") or {}
    cidrs = vpc.get("publicAccessCidrs") or []
    if not is_true(vpc.get("endpointPublicAccess")) or not cidrs:
        problems.append("the API endpoint is private only: the pipeline's runners cannot reach it")
    elif "0.0.0.0/0" in cidrs:
        problems.append("the API endpoint is public to 0.0.0.0/0, not to the pipeline's named CIDRs")
    return problems


def check_eks_reachable(resources: list[PolicyResource], config: PolicyConfig) -> list[tuple[PolicyResource, str]]:
    clusters = [r for r in resources if r.type == EKS_CLUSTER]
    policies = {str(r.props.get("policyArn")) for r in resources if r.type == EKS_ACCESS_POLICY}
    problems = [(c, message) for c in clusters for message in _cluster_reachability(c)]
    for cluster in clusters:
        if CLUSTER_ADMIN_POLICY not in policies:
            problems.append((cluster, "no access entry makes the pipeline's deploy role cluster admin"))
        if not policies.intersection(READ_ONLY_POLICIES):
            problems.append((cluster, "no access entry gives the pipeline's plan role read-only access"))
    return problems


def check_internal_load_balancers(
    resources: list[PolicyResource], config: PolicyConfig
) -> list[tuple[PolicyResource, str]]:
    clusters = [r for r in resources if r.type == EKS_CLUSTER]
    subnets = [r for r in resources if r.type == SUBNET]
    problems: list[tuple[PolicyResource, str]] = [
        (s, "a subnet is tagged for internet-facing load balancers (kubernetes.io/role/elb)")
        for s in subnets
        if PUBLIC_ELB in (s.props.get("tags") or {})
    ]
    if clusters and not any((s.props.get("tags") or {}).get(INTERNAL_ELB) == "1" for s in subnets):
        problems += [
            (c, "no subnet is tagged kubernetes.io/role/internal-elb=1 for its load balancers") for c in clusters
        ]
    for service in (r for r in resources if r.type == K8S_SERVICE and get(r.props, "spec.type") == "LoadBalancer"):
        annotations = get(service.props, "metadata.annotations") or {}
        internal = (
            annotations.get(LB_INTERNAL_ANNOTATIONS[0]) == "true"
            or annotations.get(LB_INTERNAL_ANNOTATIONS[1]) == "internal"
        )
        if not internal:
            problems.append((service, "a LoadBalancer Service is not annotated internal"))
    return problems


def check_hpa_has_metrics(resources: list[PolicyResource], config: PolicyConfig) -> list[tuple[PolicyResource, str]]:
    if any(r.type == EKS_ADDON and r.props.get("addonName") == "metrics-server" for r in resources):
        return []
    return [
        (r, "nothing serves the metrics API it reads: no metrics-server add-on") for r in resources if r.type == HPA
    ]


def check_no_reserved_concurrency(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    reserved = props.get("reservedConcurrentExecutions")
    if type_ != LAMBDA_FUNCTION or reserved is None or int(reserved) < 0:
        return []
    return [f"reserves {reserved} concurrent executions: accounts with the default quota of 10 refuse any"]


# --- encryption-at-rest -------------------------------------------------------------------------------------------


def _launch_template_volumes(props: dict[str, Any]) -> list[str]:
    problems = []
    for mapping in props.get("blockDeviceMappings", []) or []:
        ebs = mapping.get("ebs") or {}
        device = mapping.get("deviceName", "?")
        if not is_true(ebs.get("encrypted")):
            problems.append(f"volume {device} is not encrypted")
        elif not ebs.get("kmsKeyId"):
            problems.append(f"volume {device} is encrypted with the AWS-managed key, not the datacenter's KMS key")
    return problems


def check_encryption_at_rest(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    if type_ == LAUNCH_TEMPLATE:
        return _launch_template_volumes(props)
    checks: dict[str, tuple[bool, str]] = {
        "aws:ebs/volume:Volume": (is_true(props.get("encrypted")), "the volume is not encrypted"),
        "aws:kms/key:Key": (is_true(props.get("enableKeyRotation")), "the KMS key does not rotate"),
        "aws:secretsmanager/secret:Secret": (
            bool(props.get("kmsKeyId")),
            "the secret is not under the environment's KMS key",
        ),
        "aws:fsx/lustreFileSystem:LustreFileSystem": (
            bool(props.get("kmsKeyId")),
            "the file system is not under a KMS key",
        ),
        EKS_CLUSTER: (
            "secrets" in (get(props, "encryptionConfig.resources") or []),
            "Kubernetes Secrets are not envelope-encrypted with KMS",
        ),
        "aws:ecr/repository:Repository": (
            any(c.get("encryptionType") == "KMS" for c in props.get("encryptionConfigurations", []) or []),
            "images are not encrypted with KMS",
        ),
        BUCKET_ENCRYPTION: (
            all(
                str(get(r, "applyServerSideEncryptionByDefault.sseAlgorithm", "")).startswith("aws:kms")
                for r in props.get("rules", []) or [{}]
            ),
            "the bucket's default encryption is not SSE-KMS",
        ),
    }
    if type_ == "kubernetes:storage.k8s.io/v1:StorageClass" and props.get("provisioner") == "ebs.csi.aws.com":
        checks[type_] = (is_true(get(props, "parameters.encrypted")), "volumes of this class are not encrypted")
    ok, message = checks.get(type_, (True, ""))
    return [] if ok else [message]


def check_buckets_protected(resources: list[PolicyResource], config: PolicyConfig) -> list[tuple[PolicyResource, str]]:
    """Every bucket has SSE-KMS default encryption, versioning (a transfer bucket never has it), and all four
    public-access blocks."""

    def named(type_: str) -> dict[Any, PolicyResource]:
        return {r.props.get("bucket"): r for r in resources if r.type == type_}

    encryption, versioning, blocks = named(BUCKET_ENCRYPTION), named(BUCKET_VERSIONING), named(BUCKET_PUBLIC_ACCESS)
    problems = []
    for bucket in (r for r in resources if r.type == BUCKET):
        name = bucket.props.get("bucket")
        if name not in encryption:
            problems.append((bucket, "no default server-side encryption configuration"))
        versioned = versioning.get(name)
        status = get(versioned.props, "versioningConfiguration.status") if versioned is not None else None
        if (bucket.props.get("tags") or {}).get(PURPOSE_TAG) == TRANSFER_PURPOSE:
            if versioned is not None:
                problems.append((bucket, "a transfer bucket must never be versioned: its history would keep secrets"))
        elif status != "Enabled":
            problems.append((bucket, "versioning is not enabled"))
        block = blocks.get(name)
        flags = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
        if block is None or not all(is_true(block.props.get(f)) for f in flags):
            problems.append((bucket, "public access is not blocked on all four counts"))
    return problems


# --- imdsv2-required ----------------------------------------------------------------------------------------------


def check_imdsv2(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    if type_ in (LAUNCH_TEMPLATE, INSTANCE) and get(props, "metadataOptions.httpTokens") != "required":
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
        group = get(template.props, "placement.groupName")
        if group is None:
            problems.append((template, "EFA interfaces without a placement group"))
        elif strategies.get(group) != "cluster":
            problems.append((template, f"EFA needs a cluster placement group, {group!r} is {strategies.get(group)!r}"))
    return problems


# --- launch-template-interfaces -----------------------------------------------------------------------------------


def check_launch_template_interfaces(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    """EC2 refuses AssociatePublicIpAddress in a launch with more than one network interface (an EFA template has
    one per network card): such a template could not launch a single instance."""
    if type_ != LAUNCH_TEMPLATE:
        return []
    interfaces = props.get("networkInterfaces", []) or []
    if len(interfaces) < 2:
        return []
    setting = [i for i in interfaces if i.get("associatePublicIpAddress") is not None]
    if not setting:
        return []
    return [
        f"{len(interfaces)} network interfaces and associatePublicIpAddress set (on {len(setting)}): EC2 refuses "
        "the field when a launch names several interfaces; leave it unset"
    ]


# --- group-waits-for-capacity ------------------------------------------------------------------------------------


def _waits(timeout: Any) -> bool:
    """Whether a wait_for_capacity_timeout (a Go duration; the provider's default is 10m) waits at all."""
    if timeout is None:
        return True
    return any(float(n) > 0 for n in re.findall(r"\d+(?:\.\d+)?", str(timeout)))


def check_group_waits_for_capacity(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    if type_ == AUTOSCALING_GROUP and not _waits(props.get("waitForCapacityTimeout")):
        return [
            "waitForCapacityTimeout 0: `pulumi up` would report the group done with no instance in service; give "
            "it a timeout (pdstack-infra:capacity_wait_minutes)"
        ]
    return []


# --- gpu-template-has-user-data ---------------------------------------------------------------------------------

CLOUD_CONFIG = "#cloud-config"
USER_DATA_LIMIT = 16 * 1024  # EC2's, before base64 (pdstack/node/userdata.py)


def _instance_tags(props: dict[str, Any]) -> dict[str, Any]:
    specs = [s for s in props.get("tagSpecifications", []) or [] if s.get("resourceType") == "instance"]
    return (specs[0].get("tags") or {}) if specs else {}


def check_gpu_template_user_data(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    """A GPU node is cattle: what its group launches must boot by itself to a serving node (pdstack/node/userdata.py).
    A template without user data launches bare instances that serve nothing until someone runs Ansible."""
    if type_ != LAUNCH_TEMPLATE or _instance_tags(props).get("pdstack:role") not in GPU_ROLES:
        return []
    encoded = props.get("userData")
    if not encoded:
        return ["a GPU template without user data: its instances would come up bare, serving nothing"]
    try:
        text = base64.b64decode(str(encoded), validate=True)
    except (binascii.Error, ValueError):
        return ["its user data is not base64 (EC2 takes a launch template's user data base64-encoded)"]
    if len(text) > USER_DATA_LIMIT:
        return [f"its user data is {len(text)} bytes, over EC2's {USER_DATA_LIMIT}"]
    if not text.startswith(f"{CLOUD_CONFIG}\n".encode()):
        return [f"its user data is not a {CLOUD_CONFIG} document (the nodes' bootstrap, pdstack/node/userdata.py)"]
    return []


# --- gpu-group-drains ----------------------------------------------------------------------------------------------

LIFECYCLE_HOOK = "aws:autoscaling/lifecycleHook:LifecycleHook"
TERMINATING = "autoscaling:EC2_INSTANCE_TERMINATING"
HEARTBEAT_BOUNDS = (30, 7200)  # what Auto Scaling takes


def _drain_problems(hooks: list[PolicyResource]) -> list[str]:
    draining = [h for h in hooks if h.props.get("lifecycleTransition") == TERMINATING]
    if not draining:
        return ["no termination lifecycle hook: a scale-in would cut its nodes' requests instead of draining them"]
    problems = []
    for hook in draining:
        if hook.props.get("defaultResult") != "CONTINUE":
            problems.append(
                f"hook {hook.props.get('name')!r} defaults to {hook.props.get('defaultResult')!r}: a node that dies "
                "while draining must still be terminated (CONTINUE)"
            )
        timeout = hook.props.get("heartbeatTimeout")
        low, high = HEARTBEAT_BOUNDS
        if not isinstance(timeout, int | float) or not low <= timeout <= high:
            problems.append(f"hook {hook.props.get('name')!r} heartbeatTimeout {timeout!r} is not {low} to {high} s")
    return problems


def check_gpu_group_drains(resources: list[PolicyResource], config: PolicyConfig) -> list[tuple[PolicyResource, str]]:
    """Every GPU pool's Auto Scaling group has a termination lifecycle hook (the drain: the node deregisters,
    finishes its requests, completes the action) that terminates anyway once its heartbeat timeout passes."""
    hooks: dict[str, list[PolicyResource]] = {}
    for hook in (r for r in resources if r.type == LIFECYCLE_HOOK):
        hooks.setdefault(str(hook.props.get("autoscalingGroupName")), []).append(hook)
    problems = []
    for group in (r for r in resources if r.type == AUTOSCALING_GROUP):
        tags = {t.get("key"): t.get("value") for t in group.props.get("tags", []) or []}
        if tags.get("pdstack:role") not in GPU_ROLES:
            continue
        name = group.props.get("name")
        if not name:
            problems.append((group, "a GPU group without a fixed name: its nodes and its drain hook cannot name it"))
            continue
        problems += [(group, message) for message in _drain_problems(hooks.get(str(name), []))]
    return problems


# --- node-images-pullable ----------------------------------------------------------------------------------------

ECR_PULL = ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability")
ECR_LOGIN = "ecr:GetAuthorizationToken"  # ECR's login action, not a credential


def _listed(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else [str(value)] if value is not None else []


def _allowed(policies: list[PolicyResource]) -> list[tuple[set[str], list[str]]]:
    """(actions, resources) of every Allow statement of the role's inline policies."""
    found = []
    for policy in policies:
        try:
            document = json.loads(str(policy.props.get("policy") or "{}"))
        except ValueError:
            continue
        statements = document.get("Statement", []) if isinstance(document, dict) else []
        for statement in statements if isinstance(statements, list) else [statements]:
            if isinstance(statement, dict) and statement.get("Effect") == "Allow":
                found.append(
                    ({a.lower() for a in _listed(statement.get("Action"))}, _listed(statement.get("Resource")))
                )
    return found


def _pull_problems(images: list[str], allowed: list[tuple[set[str], list[str]]]) -> list[str]:
    problems = []
    if not any(ECR_LOGIN.lower() in actions and "*" in resources for actions, resources in allowed):
        problems.append(f"its role may not call {ECR_LOGIN} (on Resource *, as ECR requires): no registry login")
    for action in ECR_PULL:
        on = {r for actions, resources in allowed if action.lower() in actions or "ecr:*" in actions for r in resources}
        repositories = {r.split(":repository/", 1)[1] for r in on if ":repository/" in r}
        missing = [i for i in images if i not in repositories]
        if missing:
            problems.append(f"its role may not {action} on {', '.join(missing)}: its nodes could not pull")
        extra = sorted((repositories - set(images)) | {r for r in on if ":repository/" not in r})
        if extra:
            problems.append(f"its role may {action} on {', '.join(extra)}, which its nodes do not run")
    return problems


def check_node_images_pullable(
    resources: list[PolicyResource], config: PolicyConfig
) -> list[tuple[PolicyResource, str]]:
    """Every image a GPU node runs (its launch template's `pdstack:images`: repository names) has a repository its
    instance role may pull from (ECR's token on *, the three pull actions on exactly those repositories). The role's
    policies are the template's siblings: one node pool component holds both."""
    problems = []
    for template in (r for r in resources if r.type == LAUNCH_TEMPLATE):
        tags = _instance_tags(template.props)
        if tags.get("pdstack:role") not in GPU_ROLES:
            continue
        images = str(tags.get(IMAGES_TAG) or "").split()
        if not images:
            problems.append((template, f"its instances do not say which images they run (tag {IMAGES_TAG})"))
            continue
        siblings = [r for r in resources if r.type == ROLE_POLICY and r.parent and r.parent == template.parent]
        problems += [(template, message) for message in _pull_problems(images, _allowed(siblings))]
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
    for container in get(props, "spec.template.spec.containers") or []:
        name = container.get("name", "?")
        liveness, readiness = container.get("livenessProbe"), container.get("readinessProbe")
        if not liveness or not readiness:
            problems.append(f"container {name} needs both a liveness and a readiness probe")
        elif liveness == readiness:
            problems.append(
                f"container {name} uses one probe for liveness and readiness; they answer different questions"
            )
        requests = get(container, "resources.requests") or {}
        if not requests.get("cpu") or not requests.get("memory"):
            problems.append(f"container {name} has no cpu and memory requests")
    return problems


RESOURCE_RULES: tuple[ResourceRule, ...] = (
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
        "launch-template-interfaces",
        "A launch template with several network interfaces does not set associatePublicIpAddress (EC2 refuses it).",
        check_launch_template_interfaces,
    ),
    ResourceRule(
        "group-waits-for-capacity",
        "`pulumi up` waits for an Auto Scaling group's instances to be in service (waitForCapacityTimeout not 0).",
        check_group_waits_for_capacity,
    ),
    ResourceRule(
        "gpu-template-has-user-data",
        "Every GPU launch template carries user data: base64 of a #cloud-config document within EC2's 16 KB.",
        check_gpu_template_user_data,
    ),
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
STACK_RULES: tuple[StackRule, ...] = (
    StackRule(
        "s3-buckets-protected",
        "Buckets are SSE-KMS encrypted, versioned (transfer buckets never) and never public.",
        check_buckets_protected,
    ),
    StackRule(
        "efa-cluster-placement",
        "EFA launch templates place instances in a cluster placement group.",
        check_efa_cluster_placement,
    ),
    StackRule(
        "gpu-group-drains",
        "Every GPU Auto Scaling group drains on scale-in: a termination lifecycle hook that CONTINUEs on timeout.",
        check_gpu_group_drains,
    ),
    StackRule(
        "node-images-pullable",
        "Every image a GPU node runs has a repository its role may pull (ECR's token, pull on exactly those).",
        check_node_images_pullable,
    ),
)
STACK_RULES += (
    StackRule(
        "stateful-resources-protected",
        "KMS keys, private zones, EKS clusters, buckets and secrets are protected (a dev stack may opt out).",
        check_stateful_protected,
    ),
    StackRule(
        "no-secret-outputs",
        "No stack output holds a secret value: nothing reads one, and the state would carry it once more.",
        check_no_secret_outputs,
    ),
    StackRule(
        "eks-reachable-by-pipeline",
        "An EKS cluster authenticates by access entries, admits the pipeline's deploy role as cluster admin and its "
        "plan role read-only, and its API is reachable from named CIDRs only.",
        check_eks_reachable,
    ),
    StackRule(
        "internal-load-balancers",
        "Beside an EKS cluster, subnets tagged kubernetes.io/role/internal-elb exist, none kubernetes.io/role/elb, "
        "and every LoadBalancer Service is internal.",
        check_internal_load_balancers,
    ),
    StackRule(
        "hpa-has-metrics",
        "A HorizontalPodAutoscaler's cluster runs metrics-server (the EKS add-on).",
        check_hpa_has_metrics,
    ),
)
RESOURCE_RULES += (
    ResourceRule(
        "no-reserved-concurrency",
        "No Lambda reserves concurrency: reserving fails on accounts with the default concurrency quota of 10.",
        check_no_reserved_concurrency,
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
