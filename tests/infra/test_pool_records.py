"""A pool's names follow its Auto Scaling group: the reconciler the datacenter stacks deploy
(infra/lambdas/pool_records.py) against moto's in-process AWS (EC2, Auto Scaling, Route53; no cloud here), and the
functions, triggers and permissions in the prod graphs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from infra.lambdas.pool_records import instance_name, reconcile, record_change
from pdstack.contract.components import cloud_names
from pdstack.contract.node_lifecycle import node_group_name
from pdstack.synth.synthesis import Synthesis

NAME = cloud_names("prod").host("decode-h200", "decode-us-west-2")
REGION = "us-west-2"


@pytest.fixture
def aws() -> Iterator[dict[str, Any]]:
    with mock_aws():
        clients = {
            s: boto3.client(s, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing")
            for s in ("autoscaling", "ec2", "route53")
        }
        ec2 = clients["ec2"]
        vpc = ec2.create_vpc(CidrBlock="10.32.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.32.0.0/18", AvailabilityZone=f"{REGION}a")["Subnet"]
        template = {"ImageId": "ami-12c6146b", "InstanceType": "t3.micro"}
        ec2.create_launch_template(LaunchTemplateName="pool", LaunchTemplateData=template)
        clients["autoscaling"].create_auto_scaling_group(
            AutoScalingGroupName="pool",
            LaunchTemplate={"LaunchTemplateName": "pool"},
            MinSize=0,
            MaxSize=4,
            DesiredCapacity=2,
            VPCZoneIdentifier=subnet["SubnetId"],
        )
        zone = (
            clients["route53"]
            .create_hosted_zone(
                Name="prod.pdstack.internal",
                CallerReference="t",
                VPC={"VPCRegion": REGION, "VPCId": vpc},
                HostedZoneConfig={"PrivateZone": True},
            )["HostedZone"]["Id"]
            .rsplit("/", 1)[-1]
        )
        yield {"clients": clients, "zone": zone}


def _records(aws: dict[str, Any]) -> dict[str, list[str]]:
    """The zone's A records under the pool's name (its own included): name -> addresses."""
    sets = aws["clients"]["route53"].list_resource_record_sets(HostedZoneId=aws["zone"])["ResourceRecordSets"]
    return {
        r["Name"].rstrip("."): sorted(v["Value"] for v in r["ResourceRecords"])
        for r in sets
        if r["Type"] == "A" and (r["Name"].rstrip(".") == NAME or r["Name"].rstrip(".").endswith(f".{NAME}"))
    }


def _instances(aws: dict[str, Any]) -> dict[str, str]:
    groups = aws["clients"]["autoscaling"].describe_auto_scaling_groups(AutoScalingGroupNames=["pool"])
    ids = [i["InstanceId"] for i in groups["AutoScalingGroups"][0]["Instances"]]
    if not ids:
        return {}
    reservations = aws["clients"]["ec2"].describe_instances(InstanceIds=ids)["Reservations"]
    return {i["InstanceId"]: i["PrivateIpAddress"] for r in reservations for i in r["Instances"]}


def _expected(aws: dict[str, Any]) -> dict[str, list[str]]:
    instances = _instances(aws)
    own = {instance_name(i, NAME): [a] for i, a in instances.items()}
    return ({NAME: sorted(instances.values())} if instances else {}) | own


def test_the_records_follow_the_groups_instances(aws: dict[str, Any]) -> None:
    """The pool's name holds every InService address, and each instance's own name its address only."""
    clients, zone = aws["clients"], aws["zone"]
    assert [c["Action"] for c in reconcile(clients, zone, NAME, "pool", 60)] == ["UPSERT"] * 3
    assert _records(aws) == _expected(aws) and len(_instances(aws)) == 2
    assert reconcile(clients, zone, NAME, "pool", 60) == []  # nothing to change: no write
    clients["autoscaling"].set_desired_capacity(AutoScalingGroupName="pool", DesiredCapacity=3)
    reconcile(clients, zone, NAME, "pool", 60)
    assert _records(aws) == _expected(aws) and len(_instances(aws)) == 3
    gone = next(iter(_instances(aws)))
    clients["autoscaling"].terminate_instance_in_auto_scaling_group(
        InstanceId=gone, ShouldDecrementDesiredCapacity=True
    )
    reconcile(clients, zone, NAME, "pool", 60)
    assert instance_name(gone, NAME) not in _records(aws) and _records(aws) == _expected(aws)
    clients["autoscaling"].update_auto_scaling_group(AutoScalingGroupName="pool", MinSize=0, DesiredCapacity=0)
    assert {c["Action"] for c in reconcile(clients, zone, NAME, "pool", 60)} == {"DELETE"}  # no instance: no name
    assert _records(aws) == {}


def test_an_instances_name_is_covered_by_its_pools_certificate(graphs: dict[str, Synthesis]) -> None:
    """The seam between the reconciler's names and the certificates the control stack issues the pools: the
    instance's name falls under exactly the pool's wildcard (one label, as TLS wildcards match)."""
    names = cloud_names("prod")
    requests = {
        r.name.removeprefix("tls-"): r.inputs["dnsNames"]
        for r in graphs["prod-control"].of_type("tls:index/certRequest:CertRequest")
    }
    pool, dc = "decode-h200", "decode-us-west-2"
    (wildcard,) = [n for n in requests[f"{dc}-{pool}"] if n.startswith("*.")]
    name = instance_name("i-0123456789abcdef0", names.host(pool, dc))
    assert name.split(".", 1)[1] == wildcard.removeprefix("*.") and "." not in name.split(".", 1)[0]


def test_records_of_other_names_in_the_zone_are_left_alone(aws: dict[str, Any]) -> None:
    clients, zone = aws["clients"], aws["zone"]
    other = {"Name": f"other-{NAME}", "Type": "A", "TTL": 60, "ResourceRecords": [{"Value": "10.9.9.9"}]}
    clients["route53"].change_resource_record_sets(
        HostedZoneId=zone, ChangeBatch={"Changes": [{"Action": "UPSERT", "ResourceRecordSet": other}]}
    )
    changes = reconcile(clients, zone, NAME, "pool", 60)
    assert all(
        c["ResourceRecordSet"]["Name"].endswith(NAME) and "other-" not in c["ResourceRecordSet"]["Name"]
        for c in changes
    )
    names = [
        r["Name"].rstrip(".")
        for r in clients["route53"].list_resource_record_sets(HostedZoneId=zone)["ResourceRecordSets"]
    ]
    assert f"other-{NAME}" in names


def test_an_unchanged_set_in_another_order_is_no_change() -> None:
    current = {
        "Name": f"{NAME}.",
        "Type": "A",
        "TTL": 60,
        "ResourceRecords": [{"Value": "10.0.0.2"}, {"Value": "10.0.0.1"}],
    }
    assert record_change(NAME, 60, ["10.0.0.1", "10.0.0.2"], current) is None
    assert record_change(NAME, 30, ["10.0.0.1", "10.0.0.2"], current)["Action"] == "UPSERT"
    assert record_change(NAME, 60, [], None) is None


@pytest.mark.parametrize("name", ["prod-prefill-us-east-1", "prod-decode-us-west-2"])
def test_each_pool_has_its_reconciler_allowed_only_its_own_record(graphs: dict[str, Synthesis], name: str) -> None:
    graph = graphs[name]
    dc = name.removeprefix("prod-")
    pools = {g.name.removesuffix("-group").removeprefix(f"{dc}-") for g in graph.of_type("aws:autoscaling/group:Group")}
    functions = {
        f.inputs["environment"]["variables"]["RECORD_NAME"]: f for f in graph.of_type("aws:lambda/function:Function")
    }
    assert set(functions) == {cloud_names("prod").host(p, dc) for p in pools}
    for record, function in functions.items():
        variables = function.inputs["environment"]["variables"]
        pool = next(p for p in pools if cloud_names("prod").host(p, dc) == record)
        assert variables["GROUP_NAME"] == node_group_name("prod", dc, pool) and variables["ZONE_ID"].startswith("Z")
        policy = next(p for p in graph.of_type("aws:iam/rolePolicy:RolePolicy") if p.name == function.name)
        write = next(s for s in json.loads(policy.inputs["policy"])["Statement"] if s["Sid"] == "WriteRecord")
        assert write["Resource"] == f"arn:aws:route53:::hostedzone/{variables['ZONE_ID']}"
        assert write["Condition"]["ForAllValues:StringLike"][
            "route53:ChangeResourceRecordSetsNormalizedRecordNames"
        ] == [record, f"*.{record}"]
    patterns = [
        json.loads(r.inputs["eventPattern"])
        for r in graph.of_type("aws:cloudwatch/eventRule:EventRule")
        if "eventPattern" in r.inputs
    ]
    assert {p["detail"]["AutoScalingGroupName"][0] for p in patterns} == {node_group_name("prod", dc, p) for p in pools}
    assert len(graph.of_type("aws:lambda/permission:Permission")) == 2 * len(pools)
