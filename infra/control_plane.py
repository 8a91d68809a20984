"""The control plane's Kubernetes: an EKS cluster with KMS envelope encryption of Secrets, a CPU managed node group on
an IMDSv2 launch template, the add-ons the workloads need (metrics-server for the gateway's HPA among them), and a
provider for them.

The API endpoint is private, and public only to the named CIDRs of pdstack-infra:eks_public_access_cidrs (where the
pipeline's runners egress from; docs/cloud.md, "Reaching the cluster"). Who may use it is EKS access entries only
(authentication mode API): the pipeline's deploy role is cluster admin, its plan role (preview, nightly refresh) a
viewer that can read Secrets, which a refresh of the workloads' Secrets needs, and nothing else."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.tags import PURPOSE
from pdstack.model import NodePool

PROMETHEUS_SERVICE_ACCOUNT = "prometheus"
EBS_CSI_SERVICE_ACCOUNT = "ebs-csi-controller-sa"
METRICS_SERVER = "metrics-server"
CLUSTER_ADMIN_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"
# AmazonEKSViewPolicy hides Secrets, which `pulumi refresh` and preview of the workloads read: the admin view reads
# every resource (Secrets too) and changes none.
READ_ONLY_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSAdminViewPolicy"


def assume_policy(service: str, tag_session: bool = False) -> str:
    actions = ["sts:AssumeRole", "sts:TagSession"] if tag_session else "sts:AssumeRole"
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": actions}],
        }
    )


@dataclass(frozen=True)
class ControlPlaneArgs:
    env: str
    region: str
    kubernetes_version: str
    pool: NodePool
    vpc_id: pulumi.Input[str]
    subnet_ids: Sequence[pulumi.Input[str]]
    management_cidrs: Sequence[str]
    public_access_cidrs: Sequence[str]  # empty: the API endpoint is private only
    deploy_role_arn: str  # the pipeline's `pulumi up` role: cluster admin
    plan_role_arn: str  # the pipeline's preview and refresh role: read-only
    secrets_key_arn: pulumi.Input[str]
    volume_key_arn: pulumi.Input[str]
    namespace: str
    tags: Mapping[str, str]
    node_tags: Mapping[str, str]
    protect: bool = True  # the cluster is protected (infra/protection.py)


class ControlPlane(pulumi.ComponentResource):
    cluster: aws.eks.Cluster
    provider: k8s.Provider

    def __init__(self, name: str, args: ControlPlaneArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:control:ControlPlane", name, None, opts)
        self.args = args
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        cluster_role = self._role(f"{name}-cluster", "eks.amazonaws.com", ["AmazonEKSClusterPolicy"], child)
        api_group = aws.ec2.SecurityGroup(
            f"{name}-api",
            vpc_id=args.vpc_id,
            description="EKS API from the management subnets",
            tags=tags,
            opts=child,
        )
        for i, cidr in enumerate(args.management_cidrs):
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-api-{i}",
                security_group_id=api_group.id,
                ip_protocol="tcp",
                from_port=443,
                to_port=443,
                cidr_ipv4=cidr,
                description=f"kubectl from management {cidr}",
                tags={**tags, PURPOSE: "kube-api"},
                opts=child,
            )
        self.cluster = aws.eks.Cluster(
            f"{name}-cluster",
            name=f"pdstack-{args.env}",
            version=args.kubernetes_version,
            role_arn=cluster_role.arn,
            vpc_config={
                "subnet_ids": list(args.subnet_ids),
                "security_group_ids": [api_group.id],
                "endpoint_private_access": True,
                "endpoint_public_access": bool(args.public_access_cidrs),
                "public_access_cidrs": list(args.public_access_cidrs) or None,
            },
            encryption_config={"provider": {"key_arn": args.secrets_key_arn}, "resources": ["secrets"]},
            # Whoever creates the cluster gets no implicit admin: the deploy role's access entry below is the one
            # way in, managed here (an implicit creator entry for the same role would make that entry fail).
            access_config={"authentication_mode": "API", "bootstrap_cluster_creator_admin_permissions": False},
            enabled_cluster_log_types=["api", "audit", "authenticator"],
            tags=tags,
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(protect=args.protect or None)),
        )
        self.access = [
            self._access(f"{name}-deploy", args.deploy_role_arn, CLUSTER_ADMIN_POLICY, child),
            self._access(f"{name}-plan", args.plan_role_arn, READ_ONLY_POLICY, child),
        ]
        nodes = self._node_group(name, args, child)
        self._addons(name, nodes, child)
        self.prometheus_role = self._pod_role(
            f"{name}-prometheus",
            PROMETHEUS_SERVICE_ACCOUNT,
            args.namespace,
            child,
            inline={
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Allow",
                        "Action": ["ec2:DescribeInstances", "ec2:DescribeAvailabilityZones"],
                        "Resource": "*",
                    }
                ],
            },
        )
        self.provider = k8s.Provider(
            f"{name}-k8s",
            kubeconfig=pulumi.Output.all(
                self.cluster.name, self.cluster.endpoint, self.cluster.certificate_authority.data
            ).apply(lambda a: kubeconfig(a[0], a[1], a[2], args.region)),
            enable_server_side_apply=True,
            # the deploy role's access must exist before the provider talks to the API as that role
            opts=pulumi.ResourceOptions(parent=self, depends_on=[nodes, *self.access]),
        )
        self.register_outputs({"cluster_name": self.cluster.name})

    def _role(self, name: str, service: str, managed: list[str], opts: pulumi.ResourceOptions) -> aws.iam.Role:
        role = aws.iam.Role(name, assume_role_policy=assume_policy(service), tags=dict(self.args.tags), opts=opts)
        for policy in managed:
            aws.iam.RolePolicyAttachment(
                f"{name}-{policy}", role=role.name, policy_arn=f"arn:aws:iam::aws:policy/{policy}", opts=opts
            )
        return role

    def _access(
        self, name: str, principal_arn: str, policy_arn: str, opts: pulumi.ResourceOptions
    ) -> aws.eks.AccessPolicyAssociation:
        entry = aws.eks.AccessEntry(
            name,
            cluster_name=self.cluster.name,
            principal_arn=principal_arn,
            type="STANDARD",
            tags=dict(self.args.tags),
            opts=opts,
        )
        return aws.eks.AccessPolicyAssociation(
            name,
            cluster_name=self.cluster.name,
            principal_arn=entry.principal_arn,
            policy_arn=policy_arn,
            access_scope={"type": "cluster"},
            opts=opts,
        )

    def _node_group(self, name: str, args: ControlPlaneArgs, opts: pulumi.ResourceOptions) -> aws.eks.NodeGroup:
        role = self._role(
            f"{name}-nodes",
            "ec2.amazonaws.com",
            [
                "AmazonEKSWorkerNodePolicy",
                "AmazonEKS_CNI_Policy",
                "AmazonEC2ContainerRegistryReadOnly",
                "AmazonSSMManagedInstanceCore",
            ],
            opts,
        )
        template = aws.ec2.LaunchTemplate(
            f"{name}-nodes",
            metadata_options={
                "http_endpoint": "enabled",
                "http_tokens": "required",
                "http_put_response_hop_limit": 1,
                # no instance tags in the metadata: EKS documents them as incompatible with its nodes (a tag key
                # with characters the metadata service refuses breaks the node's bootstrap)
                "instance_metadata_tags": "disabled",
            },
            block_device_mappings=[
                {
                    "device_name": "/dev/xvda",
                    "ebs": {
                        "volume_size": args.pool.data_volume_gib or 100,
                        "volume_type": "gp3",
                        "encrypted": "true",
                        "kms_key_id": args.volume_key_arn,
                        "delete_on_termination": "true",
                    },
                }
            ],
            tag_specifications=[
                {"resource_type": kind, "tags": dict(args.node_tags)}
                for kind in ("instance", "volume", "network-interface")
            ],
            update_default_version=True,
            tags=dict(args.tags),
            opts=opts,
        )
        return aws.eks.NodeGroup(
            f"{name}-{args.pool.name}",
            cluster_name=self.cluster.name,
            node_role_arn=role.arn,
            subnet_ids=list(args.subnet_ids),
            instance_types=[args.pool.instance_type],
            ami_type="AL2023_x86_64_STANDARD",
            scaling_config={
                "min_size": args.pool.min_size,
                "desired_size": args.pool.desired_size,
                "max_size": args.pool.max_size,
            },
            update_config={"max_unavailable": 1},
            launch_template={"id": template.id, "version": template.latest_version.apply(str)},
            labels={"pdstack/pool": args.pool.name},
            tags=dict(args.node_tags),
            opts=opts,
        )

    def _addons(self, name: str, nodes: aws.eks.NodeGroup, opts: pulumi.ResourceOptions) -> None:
        after_nodes = pulumi.ResourceOptions(parent=self, depends_on=[nodes])
        aws.eks.Addon(
            f"{name}-pod-identity", cluster_name=self.cluster.name, addon_name="eks-pod-identity-agent", opts=opts
        )
        aws.eks.Addon(
            f"{name}-vpc-cni",
            cluster_name=self.cluster.name,
            addon_name="vpc-cni",
            # NetworkPolicies are only enforced when the VPC CNI's policy agent is on.
            configuration_values=json.dumps({"enableNetworkPolicy": "true"}),
            opts=opts,
        )
        # metrics-server: the resource metrics API the gateway's HorizontalPodAutoscaler reads (EKS's add-on)
        for addon in ("coredns", "kube-proxy", METRICS_SERVER):
            aws.eks.Addon(f"{name}-{addon}", cluster_name=self.cluster.name, addon_name=addon, opts=after_nodes)
        ebs_role = aws.iam.Role(
            f"{name}-ebs-csi",
            assume_role_policy=assume_policy("pods.eks.amazonaws.com", tag_session=True),
            tags=dict(self.args.tags),
            opts=opts,
        )
        aws.iam.RolePolicyAttachment(
            f"{name}-ebs-csi",
            role=ebs_role.name,
            policy_arn="arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy",
            opts=opts,
        )
        aws.iam.RolePolicy(
            f"{name}-ebs-csi-kms",
            role=ebs_role.id,
            policy=pulumi.Output.from_input(self.args.volume_key_arn).apply(
                lambda arn: json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [
                            {
                                "Effect": "Allow",
                                "Action": [
                                    "kms:CreateGrant",
                                    "kms:Decrypt",
                                    "kms:Encrypt",
                                    "kms:GenerateDataKeyWithoutPlaintext",
                                    "kms:DescribeKey",
                                    "kms:ReEncrypt*",
                                ],
                                "Resource": arn,
                            }
                        ],
                    }
                )
            ),
            opts=opts,
        )
        aws.eks.Addon(
            f"{name}-ebs-csi",
            cluster_name=self.cluster.name,
            addon_name="aws-ebs-csi-driver",
            pod_identity_associations=[{"role_arn": ebs_role.arn, "service_account": EBS_CSI_SERVICE_ACCOUNT}],
            opts=after_nodes,
        )

    def _pod_role(
        self, name: str, service_account: str, namespace: str, opts: pulumi.ResourceOptions, inline: dict[str, Any]
    ) -> aws.iam.Role:
        role = aws.iam.Role(
            name,
            assume_role_policy=assume_policy("pods.eks.amazonaws.com", tag_session=True),
            tags=dict(self.args.tags),
            opts=opts,
        )
        aws.iam.RolePolicy(name, role=role.id, policy=json.dumps(inline), opts=opts)
        aws.eks.PodIdentityAssociation(
            name,
            cluster_name=self.cluster.name,
            namespace=namespace,
            service_account=service_account,
            role_arn=role.arn,
            opts=opts,
        )
        return role


def kubeconfig(cluster: str, endpoint: str, ca_data: str, region: str) -> str:
    """A kubeconfig that authenticates with `aws eks get-token`: no long-lived credential is written anywhere."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster, "cluster": {"server": endpoint, "certificate-authority-data": ca_data}}],
            "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": cluster}}],
            "current-context": cluster,
            "users": [
                {
                    "name": cluster,
                    "user": {
                        "exec": {
                            "apiVersion": "client.authentication.k8s.io/v1beta1",
                            "command": "aws",
                            "args": ["eks", "get-token", "--cluster-name", cluster, "--region", region],
                        }
                    },
                }
            ],
        }
    )
