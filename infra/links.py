"""Private links between datacenters of one environment.

Every datacenter has a Transit Gateway hub with its own route table. A link is built by its later end in deploy
order, which finds the earlier end through a StackReference and creates both halves: the peering (Transit Gateway
peering attachment or VPC peering connection), the accepter in the peer's region, and routes both ways. Both ends
are assumed to be in one AWS account (resources in the peer's region use pulumi-aws v7's per-resource `region`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from infra import outputs
from infra.network import AZ_COUNT
from pdstack.model import LinkKind

PRIVATE_ASN_BASE = 64512


def _nth(i: int) -> Callable[[list[Any]], str]:
    return lambda items: str(items[i])


@dataclass(frozen=True)
class TransitHubArgs:
    asn: int  # distinct per datacenter of an environment: peered Transit Gateways need unique ASNs
    vpc_id: pulumi.Input[str]
    attachment_subnet_ids: Sequence[pulumi.Input[str]]
    tags: Mapping[str, str]


class TransitHub(pulumi.ComponentResource):
    gateway: aws.ec2transitgateway.TransitGateway
    route_table: aws.ec2transitgateway.RouteTable

    def __init__(self, name: str, args: TransitHubArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:links:TransitHub", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.gateway = aws.ec2transitgateway.TransitGateway(
            f"{name}-tgw",
            amazon_side_asn=args.asn,
            description=f"pdstack hub {name}",
            # Explicit route tables only: nothing is reachable until a link says so.
            default_route_table_association="disable",
            default_route_table_propagation="disable",
            auto_accept_shared_attachments="disable",
            dns_support="enable",
            tags=dict(args.tags),
            opts=child,
        )
        self.route_table = aws.ec2transitgateway.RouteTable(
            f"{name}-routes", transit_gateway_id=self.gateway.id, tags=dict(args.tags), opts=child
        )
        attachment = aws.ec2transitgateway.VpcAttachment(
            f"{name}-vpc",
            transit_gateway_id=self.gateway.id,
            vpc_id=args.vpc_id,
            subnet_ids=list(args.attachment_subnet_ids),
            transit_gateway_default_route_table_association=False,
            transit_gateway_default_route_table_propagation=False,
            tags=dict(args.tags),
            opts=child,
        )
        aws.ec2transitgateway.RouteTableAssociation(
            f"{name}-vpc",
            transit_gateway_attachment_id=attachment.id,
            transit_gateway_route_table_id=self.route_table.id,
            opts=child,
        )
        aws.ec2transitgateway.RouteTablePropagation(
            f"{name}-vpc",
            transit_gateway_attachment_id=attachment.id,
            transit_gateway_route_table_id=self.route_table.id,
            opts=child,
        )
        self.register_outputs({"transit_gateway_id": self.gateway.id, "route_table_id": self.route_table.id})


@dataclass(frozen=True)
class LocalEnd:
    region: str
    cidr: str
    vpc_id: pulumi.Input[str]
    route_table_ids: Sequence[pulumi.Input[str]]
    transit_gateway_id: pulumi.Input[str]
    transit_gateway_route_table_id: pulumi.Input[str]


@dataclass(frozen=True)
class PeerLinkArgs:
    kind: LinkKind
    local: LocalEnd
    peer_stack: str  # fully qualified: org/project/stack
    peer_region: str
    peer_cidr: str
    tags: Mapping[str, str]


class PeerLink(pulumi.ComponentResource):
    def __init__(self, name: str, args: PeerLinkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:links:PeerLink", name, None, opts)
        self.args = args
        self.child = pulumi.ResourceOptions(parent=self)
        self.peer = pulumi.StackReference(f"{name}-peer", stack_name=args.peer_stack, opts=self.child)
        if args.kind is LinkKind.TRANSIT_GATEWAY:
            self._transit_gateway_peering(name)
        elif args.kind is LinkKind.VPC_PEERING:
            self._vpc_peering(name)
        else:
            raise ValueError(f"link kind {args.kind} cannot be built in the cloud")
        self.register_outputs({})

    def _peer(self, key: str) -> pulumi.Output[Any]:
        return self.peer.require_output(key)

    def _peer_route_tables(self) -> list[pulumi.Output[str]]:
        ids = self._peer(outputs.PRIVATE_ROUTE_TABLE_IDS)
        return [ids.apply(_nth(i)) for i in range(AZ_COUNT)]

    def _vpc_peering(self, name: str) -> None:
        a = self.args
        connection = aws.ec2.VpcPeeringConnection(
            f"{name}-pcx",
            vpc_id=a.local.vpc_id,
            peer_vpc_id=self._peer(outputs.VPC_ID),
            peer_owner_id=self._peer(outputs.ACCOUNT_ID),
            peer_region=a.peer_region,
            tags=dict(a.tags),
            opts=self.child,
        )
        accepter = aws.ec2.VpcPeeringConnectionAccepter(
            f"{name}-pcx-accept",
            vpc_peering_connection_id=connection.id,
            auto_accept=True,
            region=a.peer_region,
            tags=dict(a.tags),
            opts=self.child,
        )
        after = pulumi.ResourceOptions(parent=self, depends_on=[accepter])
        for i, table in enumerate(a.local.route_table_ids):
            aws.ec2.Route(
                f"{name}-out-{i}",
                route_table_id=table,
                destination_cidr_block=a.peer_cidr,
                vpc_peering_connection_id=connection.id,
                opts=after,
            )
        for i, table in enumerate(self._peer_route_tables()):
            aws.ec2.Route(
                f"{name}-back-{i}",
                route_table_id=table,
                destination_cidr_block=a.local.cidr,
                vpc_peering_connection_id=connection.id,
                region=a.peer_region,
                opts=after,
            )

    def _transit_gateway_peering(self, name: str) -> None:
        a = self.args
        attachment = aws.ec2transitgateway.PeeringAttachment(
            f"{name}-tgw-peering",
            transit_gateway_id=a.local.transit_gateway_id,
            peer_transit_gateway_id=self._peer(outputs.TRANSIT_GATEWAY_ID),
            peer_account_id=self._peer(outputs.ACCOUNT_ID),
            peer_region=a.peer_region,
            tags=dict(a.tags),
            opts=self.child,
        )
        accepter = aws.ec2transitgateway.PeeringAttachmentAccepter(
            f"{name}-tgw-accept",
            transit_gateway_attachment_id=attachment.id,
            region=a.peer_region,
            tags=dict(a.tags),
            opts=self.child,
        )
        after = pulumi.ResourceOptions(parent=self, depends_on=[accepter])
        peer_table = self._peer(outputs.TRANSIT_GATEWAY_ROUTE_TABLE_ID)
        for side, table, cidr, region in (
            ("out", a.local.transit_gateway_route_table_id, a.peer_cidr, None),
            ("back", peer_table, a.local.cidr, a.peer_region),
        ):
            aws.ec2transitgateway.RouteTableAssociation(
                f"{name}-tgw-{side}",
                transit_gateway_attachment_id=attachment.id,
                transit_gateway_route_table_id=table,
                region=region,
                opts=after,
            )
            aws.ec2transitgateway.Route(
                f"{name}-tgw-{side}",
                destination_cidr_block=cidr,
                transit_gateway_attachment_id=attachment.id,
                transit_gateway_route_table_id=table,
                region=region,
                opts=after,
            )
        for i, table in enumerate(a.local.route_table_ids):
            aws.ec2.Route(
                f"{name}-out-{i}",
                route_table_id=table,
                destination_cidr_block=a.peer_cidr,
                transit_gateway_id=a.local.transit_gateway_id,
                opts=after,
            )
        peer_gateway = self._peer(outputs.TRANSIT_GATEWAY_ID)
        for i, table in enumerate(self._peer_route_tables()):
            aws.ec2.Route(
                f"{name}-back-{i}",
                route_table_id=table,
                destination_cidr_block=a.local.cidr,
                transit_gateway_id=peer_gateway,
                region=a.peer_region,
                opts=after,
            )
