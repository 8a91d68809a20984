"""Names: one Route53 private hosted zone per environment (<env>.<domain>), associated with every datacenter's VPC,
holding the names pdstack.contract.components.Names gives the gateway, the scheduler and each server pool.

The zone is made once, by the control-plane stack: it is deployed first (infra/environment.DEPLOY_RANK), every
datacenter stack already reads it by StackReference, and a zone that belongs to the environment must not go away
with one datacenter's stack. Each datacenter stack associates its own VPC with it (`ZoneAssociation`, in its own
region: a private zone is global, an association names the VPC's region). The zone's inline VPC list therefore
holds the control VPC alone and ignores changes, the pairing the provider documents: inline associations and
ZoneAssociation resources on one zone otherwise undo each other on every update."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.protection import stateful

RECORD_TTL_S = 60  # short: a load balancer's or a pool's addresses change without the name changing
DNS_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
MAX_ZONE_LENGTH = 200  # a 253-character name leaves room for <pool>.<datacenter>. under the zone


def dns_domain_problem(domain: str) -> str | None:
    """Why `domain` cannot hold an environment's zone, or None: lower-case DNS labels, not too long."""
    labels = domain.split(".")
    if len(labels) < 2 or not all(DNS_LABEL.match(label) for label in labels):
        return f"{domain!r} is not a lower-case DNS name of two labels or more (e.g. pdstack.internal)"
    if len(domain) > MAX_ZONE_LENGTH:
        return f"{domain!r} is longer than {MAX_ZONE_LENGTH} characters"
    return None


@dataclass(frozen=True)
class PrivateZoneArgs:
    zone: str  # <env>.<domain>: pdstack.contract.components.cloud_names(env, domain).zone
    vpc_id: pulumi.Input[str]  # the control plane's VPC
    region: str  # its region
    tags: Mapping[str, str]


class PrivateZone(pulumi.ComponentResource):
    zone: aws.route53.Zone

    def __init__(self, name: str, args: PrivateZoneArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:dns:PrivateZone", name, None, opts)
        self.zone = aws.route53.Zone(
            f"{name}-zone",
            name=args.zone,
            comment=f"pdstack: the names of {args.zone}'s components and server pools",
            vpcs=[aws.route53.ZoneVpcArgs(vpc_id=args.vpc_id, vpc_region=args.region)],
            tags=dict(args.tags),
            # the datacenter stacks add their VPCs with ZoneAssociation (module docstring)
            opts=stateful(pulumi.ResourceOptions(parent=self, ignore_changes=["vpcs"])),
        )
        self.register_outputs({"zone_id": self.zone.zone_id, "name": self.zone.name})

    def alias(self, name: str, fqdn: str, target: pulumi.Input[str | None]) -> aws.route53.Record:
        """`fqdn` as a CNAME of `target` (a load balancer's DNS name)."""
        return aws.route53.Record(
            name,
            zone_id=self.zone.zone_id,
            name=fqdn,
            type="CNAME",
            ttl=RECORD_TTL_S,
            records=[pulumi.Output.from_input(target).apply(lambda host: host or "")],
            opts=pulumi.ResourceOptions(parent=self),
        )


@dataclass(frozen=True)
class ZoneMembershipArgs:
    zone_id: pulumi.Input[str]  # the control plane's zone (outputs.PRIVATE_ZONE_ID)
    vpc_id: pulumi.Input[str]  # this datacenter's VPC
    region: str


class ZoneMembership(pulumi.ComponentResource):
    """A datacenter's VPC joins the environment's zone: its nodes resolve every name in it."""

    association: aws.route53.ZoneAssociation

    def __init__(self, name: str, args: ZoneMembershipArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:dns:ZoneMembership", name, None, opts)
        self.association = aws.route53.ZoneAssociation(
            f"{name}-zone",
            zone_id=args.zone_id,
            vpc_id=args.vpc_id,
            vpc_region=args.region,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.register_outputs({"association_id": self.association.id})
