"""Security groups of a datacenter's GPU nodes: each opening names its purpose and its narrowest source.

Serving ports open only to the control plane (gateway, Prometheus), the KV port only to the peer datacenters that
pull KV, EFA traffic only within the group. Nothing opens to 0.0.0.0/0. No SSH: operators and Ansible come in through
SSM Session Manager (infra/operator_access.py), whose agent connects out; even SSH with the optional key pair
(pdstack-infra:ssh_key_name) runs inside a session (AWS-StartSSHSession reaches the node's sshd on localhost), so no
port 22 opens to any network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.tags import PURPOSE
from pdstack.contract.components import Component, Contract
from pdstack.model import DatacenterRole, PoolRole


@dataclass(frozen=True)
class Opening:
    """One ingress rule: a port range from either CIDRs or the group itself (`self_only`)."""

    purpose: str
    from_port: int
    to_port: int
    protocol: str = "tcp"
    cidrs: tuple[str, ...] = ()
    self_only: bool = False


@dataclass(frozen=True)
class NodeAccess:
    """Who may reach a datacenter's nodes, derived from the environment's stack files."""

    pool_roles: frozenset[PoolRole]
    datacenter_role: DatacenterRole
    contract: Contract  # the ports each component listens on (pdstack/contract/components.py)
    own_cidr: str
    control_cidr: str
    kv_peer_cidrs: tuple[str, ...]  # linked datacenters that pull KV from this one
    efa: bool


def node_openings(access: NodeAccess) -> list[Opening]:
    control = (access.control_cidr,)
    served = access.contract
    openings: list[Opening] = []
    for role, component in ((PoolRole.PREFILL, Component.PREFILL), (PoolRole.DECODE, Component.DECODE)):
        if role in access.pool_roles:
            port = served[component].port
            openings.append(Opening(f"serving-{role}", port, port, cidrs=control))
    kv_ports = served[Component.PREFILL].kv_ports  # one per vLLM worker (TP x DP) or one for pdserve
    if PoolRole.PREFILL in access.pool_roles and kv_ports:
        kv_sources = access.kv_peer_cidrs
        if access.datacenter_role is DatacenterRole.MIXED:
            kv_sources = (access.own_cidr, *kv_sources)  # decode in the same datacenter pulls locally
        if kv_sources:
            openings.append(Opening("kv", kv_ports[0], kv_ports[-1], cidrs=tuple(sorted(set(kv_sources)))))
    metrics = served.node_exporter.port
    openings.append(Opening("metrics", metrics, metrics, cidrs=control))
    if access.efa:
        # EFA's SRD traffic is not TCP/UDP: the group must admit all protocols from itself.
        openings.append(Opening("efa", -1, -1, protocol="-1", self_only=True))
    return openings


@dataclass(frozen=True)
class NodeSecurityArgs:
    vpc_id: pulumi.Input[str]
    access: NodeAccess
    tags: Mapping[str, str]


class NodeSecurity(pulumi.ComponentResource):
    group: aws.ec2.SecurityGroup

    def __init__(self, name: str, args: NodeSecurityArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:security:NodeSecurity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.group = aws.ec2.SecurityGroup(
            f"{name}-nodes",
            vpc_id=args.vpc_id,
            description="pdstack GPU nodes: serving from control, KV from peers",
            tags={**args.tags, "Name": f"{name}-nodes"},
            opts=child,
        )
        for opening in node_openings(args.access):
            self._ingress(name, opening, args.tags, child)
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-egress",
            security_group_id=self.group.id,
            ip_protocol="-1",
            cidr_ipv4="0.0.0.0/0",
            description="outbound: NAT, S3 endpoint, SSM, ECR, peers",
            tags={**args.tags, PURPOSE: "egress"},
            opts=child,
        )
        if args.access.efa:
            aws.vpc.SecurityGroupEgressRule(
                f"{name}-efa-egress",
                security_group_id=self.group.id,
                ip_protocol="-1",
                referenced_security_group_id=self.group.id,
                description="EFA: all traffic to the group itself",
                tags={**args.tags, PURPOSE: "efa"},
                opts=child,
            )
        self.register_outputs({"security_group_id": self.group.id})

    def _ingress(self, name: str, opening: Opening, tags: Mapping[str, str], opts: pulumi.ResourceOptions) -> None:
        all_protocols = opening.protocol == "-1"  # AWS refuses port numbers on all-protocol rules
        from_port = None if all_protocols else opening.from_port
        to_port = None if all_protocols else opening.to_port
        rule_tags = {**tags, PURPOSE: opening.purpose}
        if opening.self_only:
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-{opening.purpose}-self",
                security_group_id=self.group.id,
                ip_protocol=opening.protocol,
                referenced_security_group_id=self.group.id,
                description=f"{opening.purpose} within the group",
                tags=rule_tags,
                from_port=from_port,
                to_port=to_port,
                opts=opts,
            )
            return
        for i, cidr in enumerate(opening.cidrs):
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-{opening.purpose}-{i}",
                security_group_id=self.group.id,
                ip_protocol=opening.protocol,
                cidr_ipv4=cidr,
                description=f"{opening.purpose} from {cidr}",
                tags=rule_tags,
                from_port=from_port,
                to_port=to_port,
                opts=opts,
            )
