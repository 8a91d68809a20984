"""A server pool's DNS names, kept equal to its Auto Scaling group: one A record, <pool>.<datacenter>.<zone>, holding
the private address of every InService instance (none: no record), and one per instance, <instance-id>.<pool>.
<datacenter>.<zone>, holding its own address (the name a server advertises and its pool's certificate covers with
its wildcard). Run on each launch and termination of the group's instances (EventBridge) and every few minutes (a
missed event heals); each run reconciles every one of the pool's records in one change batch, so runs in any order
converge. Settings from the environment: ZONE_ID, RECORD_NAME, GROUP_NAME, RECORD_TTL."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
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


def instance_name(instance_id: str, pool_name: str) -> str:
    return f"{instance_id}.{pool_name}"


def pool_changes(
    name: str, ttl: int, instances: Mapping[str, str], current: Mapping[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The changes that make the pool's record and its instances' records (`current`: by name, without the final
    dot) match `instances` (InService instance id -> address); records of instances gone are deleted."""
    wanted = {name: sorted(instances.values())} | {instance_name(i, name): [a] for i, a in instances.items()}
    names = sorted(set(wanted) | set(current))
    changes = [record_change(n, ttl, wanted.get(n, []), current.get(n)) for n in names]
    return [c for c in changes if c is not None]


def in_service_addresses(autoscaling: Any, ec2: Any, group: str) -> dict[str, str]:
    """InService instance id -> private address."""
    groups = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]
    ids = [i["InstanceId"] for g in groups for i in g["Instances"] if i["LifecycleState"] == IN_SERVICE]
    if not ids:
        return {}
    reservations = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return {
        i["InstanceId"]: i["PrivateIpAddress"]
        for r in reservations
        for i in r["Instances"]
        if i.get("PrivateIpAddress")
    }


def current_records(route53: Any, zone_id: str, name: str) -> dict[str, dict[str, Any]]:
    """The zone's A records named `name` or under it, by name without the final dot."""
    found: dict[str, dict[str, Any]] = {}
    for page in route53.get_paginator("list_resource_record_sets").paginate(HostedZoneId=zone_id):
        for record in page["ResourceRecordSets"]:
            record_name = record["Name"].rstrip(".")
            if record["Type"] == "A" and (record_name == name or record_name.endswith(f".{name}")):
                found[record_name] = record
    return found


def reconcile(clients: dict[str, Any], zone_id: str, name: str, group: str, ttl: int) -> list[dict[str, Any]]:
    """Apply the changes the group's instances call for, in one batch; the changes (none: nothing written)."""
    instances = in_service_addresses(clients["autoscaling"], clients["ec2"], group)
    changes = pool_changes(name, ttl, instances, current_records(clients["route53"], zone_id, name))
    if changes:
        clients["route53"].change_resource_record_sets(HostedZoneId=zone_id, ChangeBatch={"Changes": changes})
    return changes


def handler(event: dict[str, Any], context: object) -> dict[str, Any]:
    boto3: Any = importlib.import_module("boto3")  # the Lambda runtime's; not a dependency of the program
    clients = {service: boto3.client(service) for service in ("autoscaling", "ec2", "route53")}
    env = os.environ
    changes = reconcile(clients, env["ZONE_ID"], env["RECORD_NAME"], env["GROUP_NAME"], int(env["RECORD_TTL"]))
    return {"changed": len(changes), "actions": [(c["Action"], c["ResourceRecordSet"]["Name"]) for c in changes]}
