"""One datacenter's VPC: two availability zones, separate public, management, service and transit subnets,
NAT, route tables, an S3 gateway endpoint and VPC flow logs."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network

import pulumi
import pulumi_aws as aws

AZ_COUNT = 2
# Where Kubernetes' load balancers land (the AWS Load Balancer Controller and the in-tree controller choose subnets
# by these tags): internal ones in the service subnets, whose route tables reach the peer VPCs, so the GPU nodes'
# heartbeats get to the scheduler. No subnet carries kubernetes.io/role/elb: the public subnets hold the NAT
# gateways only, and no internet-facing load balancer is intended.
INTERNAL_ELB_TAG = "kubernetes.io/role/internal-elb"
PUBLIC_ELB_TAG = "kubernetes.io/role/elb"
SUBNET_ROLE_TAGS: dict[str, dict[str, str]] = {"service": {INTERNAL_ELB_TAG: "1"}}
FLOW_LOG_RETENTION_DAYS = 365


@dataclass(frozen=True)
class SubnetPlan:
    """Address plan of one VPC; each list holds one subnet per availability zone."""

    service: list[IPv4Network]  # GPU nodes and EKS nodes: the bulk of the space (EFA and pod IPs)
    management: list[IPv4Network]  # bastions / SSM-managed hosts; the only SSH source
    public: list[IPv4Network]  # NAT gateways only; nothing else gets a public address
    transit: list[IPv4Network]  # Transit Gateway attachments, as AWS recommends: small and dedicated


def plan_subnets(cidr: IPv4Network) -> SubnetPlan:
    """Half the VPC for the service subnets, sixteenths for the rest (a /24 still yields AWS's minimum /28)."""
    quarters = list(cidr.subnets(new_prefix=cidr.prefixlen + 2))
    small = [s for q in quarters[2:] for s in q.subnets(new_prefix=cidr.prefixlen + 4)]
    return SubnetPlan(service=quarters[:2], public=small[0:2], management=small[2:4], transit=small[4:6])


def _nth(i: int) -> Callable[[list[str]], str]:
    return lambda items: items[i]


@dataclass(frozen=True)
class NetworkArgs:
    env: str
    dc: str
    region: str
    cidr: IPv4Network
    tags: Mapping[str, str]
    nat_per_zone: bool  # one NAT per zone survives a zone outage; dev saves the second gateway
    availability_zones: list[str] | None = None


class Network(pulumi.ComponentResource):
    vpc: aws.ec2.Vpc
    zones: list[pulumi.Output[str]]
    service_subnets: list[aws.ec2.Subnet]
    management_subnets: list[aws.ec2.Subnet]
    transit_subnets: list[aws.ec2.Subnet]
    private_route_tables: list[aws.ec2.RouteTable]
    plan: SubnetPlan

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:network:Network", name, None, opts)
        self.args, self.plan = args, plan_subnets(args.cidr)
        child = pulumi.ResourceOptions(parent=self)
        self.zones = self._zones(args)
        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=str(args.cidr),
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags={**args.tags, "Name": f"pdstack-{args.env}-{args.dc}"},
            opts=child,
        )
        vpc_child = pulumi.ResourceOptions(parent=self.vpc)
        public = self._subnets(name, "public", self.plan.public, vpc_child)
        self.management_subnets = self._subnets(name, "management", self.plan.management, vpc_child)
        self.service_subnets = self._subnets(name, "service", self.plan.service, vpc_child)
        self.transit_subnets = self._subnets(name, "transit", self.plan.transit, vpc_child)
        self._public_routing(name, public, vpc_child)
        nats = self._nat_gateways(name, public, vpc_child)
        self.private_route_tables = self._private_routing(name, nats, vpc_child)
        self._s3_endpoint(name, vpc_child)
        self._flow_logs(name, child)
        self.register_outputs(
            {
                "vpc_id": self.vpc.id,
                "service_subnet_ids": [s.id for s in self.service_subnets],
                "private_route_table_ids": [t.id for t in self.private_route_tables],
            }
        )

    def _zones(self, args: NetworkArgs) -> list[pulumi.Output[str]]:
        if args.availability_zones:
            return [pulumi.Output.from_input(z) for z in args.availability_zones]
        available = aws.get_availability_zones_output(
            state="available",
            filters=[{"name": "opt-in-status", "values": ["opt-in-not-required"]}],
            opts=pulumi.InvokeOutputOptions(parent=self),
        )
        return [available.names.apply(_nth(i)) for i in range(AZ_COUNT)]

    def _subnets(
        self, name: str, tier: str, cidrs: list[IPv4Network], opts: pulumi.ResourceOptions
    ) -> list[aws.ec2.Subnet]:
        return [
            aws.ec2.Subnet(
                f"{name}-{tier}-{i}",
                vpc_id=self.vpc.id,
                cidr_block=str(cidr),
                availability_zone=self.zones[i],
                map_public_ip_on_launch=False,
                tags={
                    **self.args.tags,
                    "Name": f"pdstack-{self.args.dc}-{tier}-{i}",
                    "pdstack:tier": tier,
                    **SUBNET_ROLE_TAGS.get(tier, {}),
                },
                opts=opts,
            )
            for i, cidr in enumerate(cidrs)
        ]

    def _public_routing(self, name: str, public: list[aws.ec2.Subnet], opts: pulumi.ResourceOptions) -> None:
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=self.vpc.id, tags=dict(self.args.tags), opts=opts)
        table = aws.ec2.RouteTable(f"{name}-public", vpc_id=self.vpc.id, tags=dict(self.args.tags), opts=opts)
        aws.ec2.Route(
            f"{name}-public-default",
            route_table_id=table.id,
            destination_cidr_block="0.0.0.0/0",
            gateway_id=igw.id,
            opts=opts,
        )
        for i, subnet in enumerate(public):
            aws.ec2.RouteTableAssociation(f"{name}-public-{i}", route_table_id=table.id, subnet_id=subnet.id, opts=opts)

    def _nat_gateways(
        self, name: str, public: list[aws.ec2.Subnet], opts: pulumi.ResourceOptions
    ) -> list[aws.ec2.NatGateway]:
        count = AZ_COUNT if self.args.nat_per_zone else 1
        nats: list[aws.ec2.NatGateway] = []
        for i in range(count):
            eip = aws.ec2.Eip(f"{name}-nat-{i}", domain="vpc", tags=dict(self.args.tags), opts=opts)
            nats.append(
                aws.ec2.NatGateway(
                    f"{name}-nat-{i}",
                    allocation_id=eip.id,
                    subnet_id=public[i].id,
                    tags=dict(self.args.tags),
                    opts=opts,
                )
            )
        return nats

    def _private_routing(
        self, name: str, nats: list[aws.ec2.NatGateway], opts: pulumi.ResourceOptions
    ) -> list[aws.ec2.RouteTable]:
        tables: list[aws.ec2.RouteTable] = []
        for i in range(AZ_COUNT):
            table = aws.ec2.RouteTable(
                f"{name}-private-{i}",
                vpc_id=self.vpc.id,
                tags={**self.args.tags, "Name": f"pdstack-{self.args.dc}-private-{i}"},
                opts=opts,
            )
            aws.ec2.Route(
                f"{name}-private-{i}-default",
                route_table_id=table.id,
                destination_cidr_block="0.0.0.0/0",
                nat_gateway_id=nats[min(i, len(nats) - 1)].id,
                opts=opts,
            )
            for tier, subnets in (
                ("management", self.management_subnets),
                ("service", self.service_subnets),
                ("transit", self.transit_subnets),
            ):
                aws.ec2.RouteTableAssociation(
                    f"{name}-{tier}-{i}", route_table_id=table.id, subnet_id=subnets[i].id, opts=opts
                )
            tables.append(table)
        return tables

    def _s3_endpoint(self, name: str, opts: pulumi.ResourceOptions) -> None:
        # Model weights come from S3: through the free gateway endpoint, not through NAT at $0.045/GB.
        aws.ec2.VpcEndpoint(
            f"{name}-s3",
            vpc_id=self.vpc.id,
            service_name=f"com.amazonaws.{self.args.region}.s3",
            vpc_endpoint_type="Gateway",
            route_table_ids=[t.id for t in self.private_route_tables],
            tags=dict(self.args.tags),
            opts=opts,
        )

    def _flow_logs(self, name: str, opts: pulumi.ResourceOptions) -> None:
        group = aws.cloudwatch.LogGroup(
            f"{name}-flow-logs",
            name=f"/pdstack/{self.args.env}/{self.args.dc}/vpc-flow-logs",
            retention_in_days=FLOW_LOG_RETENTION_DAYS,
            tags=dict(self.args.tags),
            opts=opts,
        )
        role = aws.iam.Role(
            f"{name}-flow-logs",
            assume_role_policy=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Principal": {"Service": "vpc-flow-logs.amazonaws.com"},
                            "Action": "sts:AssumeRole",
                        }
                    ],
                }
            ),
            tags=dict(self.args.tags),
            opts=opts,
        )
        aws.iam.RolePolicy(
            f"{name}-flow-logs",
            role=role.id,
            policy=group.arn.apply(
                lambda arn: json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [
                            {
                                "Effect": "Allow",
                                "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                                "Resource": [arn, f"{arn}:*"],
                            }
                        ],
                    }
                )
            ),
            opts=opts,
        )
        aws.ec2.FlowLog(
            f"{name}-flow-logs",
            vpc_id=self.vpc.id,
            traffic_type="ALL",
            log_destination_type="cloud-watch-logs",
            log_destination=group.arn,
            iam_role_arn=role.arn,
            max_aggregation_interval=60,
            tags=dict(self.args.tags),
            opts=opts,
        )
