"""A server pool's DNS name, kept equal to its Auto Scaling group: one A record, <pool>.<datacenter>.<zone>, holding
the private address of every InService instance (none: no record). Run on each launch and termination of the group's
instances (EventBridge) and every few minutes (a missed event heals); each run reconciles the whole record, so runs
in any order converge. Settings from the environment: ZONE_ID, RECORD_NAME, GROUP_NAME, RECORD_TTL."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from typing import Any

IN_SERVICE = "InService"


def record_change(
    name: str, ttl: int, addresses: Iterable[str], current: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The Route53 change that makes `name` hold exactly `addresses`; None when it already does."""
    values = sorted(set(addresses))
    if not values:
        return None if current is None else {"Action": "DELETE", "ResourceRecordSet": current}
    wanted = {"Name": name, "Type": "A", "TTL": ttl, "ResourceRecords": [{"Value": v} for v in values]}
    held = sorted(r["Value"] for r in current.get("ResourceRecords", [])) if current is not None else None
    if held == values and current is not None and current.get("TTL") == ttl:
        return None
    return {"Action": "UPSERT", "ResourceRecordSet": wanted}


def in_service_addresses(autoscaling: Any, ec2: Any, group: str) -> list[str]:
    groups = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]
    ids = [i["InstanceId"] for g in groups for i in g["Instances"] if i["LifecycleState"] == IN_SERVICE]
    if not ids:
        return []
    reservations = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return [i["PrivateIpAddress"] for r in reservations for i in r["Instances"] if i.get("PrivateIpAddress")]


def current_record(route53: Any, zone_id: str, name: str) -> dict[str, Any] | None:
    found = route53.list_resource_record_sets(
        HostedZoneId=zone_id, StartRecordName=name, StartRecordType="A", MaxItems="1"
    )["ResourceRecordSets"]
    match = [r for r in found if r["Name"].rstrip(".") == name.rstrip(".") and r["Type"] == "A"]
    return match[0] if match else None


def reconcile(clients: dict[str, Any], zone_id: str, name: str, group: str, ttl: int) -> dict[str, Any] | None:
    """Apply the change the group's instances call for; the change, or None."""
    addresses = in_service_addresses(clients["autoscaling"], clients["ec2"], group)
    change = record_change(name, ttl, addresses, current_record(clients["route53"], zone_id, name))
    if change is not None:
        clients["route53"].change_resource_record_sets(HostedZoneId=zone_id, ChangeBatch={"Changes": [change]})
    return change


def handler(event: dict[str, Any], context: object) -> dict[str, Any]:
    boto3: Any = importlib.import_module("boto3")  # the Lambda runtime's; not a dependency of the program
    clients = {service: boto3.client(service) for service in ("autoscaling", "ec2", "route53")}
    env = os.environ
    change = reconcile(clients, env["ZONE_ID"], env["RECORD_NAME"], env["GROUP_NAME"], int(env["RECORD_TTL"]))
    return {"changed": change is not None, "action": change["Action"] if change else None}
