"""A server pool's names in the environment's zone (pdstack.contract.components.Names): <pool>.<datacenter>.<zone>, an
A record of its InService instances' addresses, and <instance-id>.<pool>.<datacenter>.<zone> for each of them, kept by
a small Lambda function (infra/lambdas/pool_records.py) that EventBridge runs on every launch and termination in the
pool's Auto Scaling group and every RECONCILE_MINUTES. Instances come and go without a `pulumi up`, so the program
cannot write these addresses itself; the function may change only the pool's A records of the zone."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_aws as aws

from infra.control_plane import assume_policy
from infra.dns import RECORD_TTL_S

HANDLER = Path(__file__).resolve().parent / "lambdas" / "pool_records.py"
RECONCILE_MINUTES = 5
LAMBDA_RUNTIME = "python3.12"
LOG_RETENTION_DAYS = 30
INSTANCE_EVENTS = ("EC2 Instance Launch Successful", "EC2 Instance Terminate Successful")


@dataclass(frozen=True)
class PoolRecordsArgs:
    record_name: pulumi.Input[str]  # Names.host(pool, datacenter), under the control stack's zone name
    zone_id: pulumi.Input[str]
    group_name: pulumi.Input[str]  # the pool's Auto Scaling group
    tags: Mapping[str, str]


def function_policy(zone_id: str, record_name: str) -> str:
    """Read the group and its instances; change only the pool's own A records: its name and the names under it."""
    zone = f"arn:aws:route53:::hostedzone/{zone_id}"
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "ReadGroup",
                    "Effect": "Allow",
                    "Action": ["autoscaling:DescribeAutoScalingGroups", "ec2:DescribeInstances"],
                    "Resource": "*",  # neither action supports resource-level permissions
                },
                {"Sid": "ReadRecord", "Effect": "Allow", "Action": "route53:ListResourceRecordSets", "Resource": zone},
                {
                    "Sid": "WriteRecord",
                    "Effect": "Allow",
                    "Action": "route53:ChangeResourceRecordSets",
                    "Resource": zone,
                    "Condition": {
                        "ForAllValues:StringLike": {
                            "route53:ChangeResourceRecordSetsNormalizedRecordNames": [record_name, f"*.{record_name}"],
                            "route53:ChangeResourceRecordSetsRecordTypes": ["A"],
                        }
                    },
                },
            ],
        }
    )


class PoolRecords(pulumi.ComponentResource):
    function: aws.lambda_.Function

    def __init__(self, name: str, args: PoolRecordsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:dns:PoolRecords", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        role = aws.iam.Role(
            f"{name}-records", assume_role_policy=assume_policy("lambda.amazonaws.com"), tags=tags, opts=child
        )
        aws.iam.RolePolicyAttachment(
            f"{name}-records-logs",
            role=role.name,
            policy_arn="arn:aws:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole",
            opts=child,
        )
        policy = aws.iam.RolePolicy(
            f"{name}-records",
            role=role.id,
            policy=pulumi.Output.all(args.zone_id, args.record_name).apply(lambda a: function_policy(a[0], a[1])),
            opts=child,
        )
        logs = aws.cloudwatch.LogGroup(f"{name}-records", retention_in_days=LOG_RETENTION_DAYS, tags=tags, opts=child)
        self.function = aws.lambda_.Function(
            f"{name}-records",
            runtime=LAMBDA_RUNTIME,
            handler="pool_records.handler",
            role=role.arn,
            code=pulumi.AssetArchive({"pool_records.py": pulumi.FileAsset(str(HANDLER))}),
            timeout=30,
            # No reserved concurrency: reserving any fails on accounts with the default quota of 10 (AWS keeps 10
            # unreserved), and none is needed: each run reconciles all of the pool's records in one change batch
            # from the group's state then, so concurrent runs converge and the scheduled run heals a stale write.
            logging_config={"log_format": "JSON", "log_group": logs.name},
            environment={
                "variables": {
                    "ZONE_ID": args.zone_id,
                    "RECORD_NAME": args.record_name,
                    "GROUP_NAME": args.group_name,
                    "RECORD_TTL": str(RECORD_TTL_S),
                }
            },
            description=pulumi.Output.concat("pdstack: keeps ", args.record_name, " and its instances' names current"),
            tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[policy]),
        )
        pattern = pulumi.Output.from_input(args.group_name).apply(
            lambda group: json.dumps(
                {
                    "source": ["aws.autoscaling"],
                    "detail-type": list(INSTANCE_EVENTS),
                    "detail": {"AutoScalingGroupName": [group]},
                }
            )
        )
        self._trigger(f"{name}-events", child, tags, event_pattern=pattern)
        self._trigger(f"{name}-reconcile", child, tags, schedule_expression=f"rate({RECONCILE_MINUTES} minutes)")
        self.register_outputs({"function": self.function.name, "record_name": args.record_name})

    def _trigger(
        self,
        name: str,
        opts: pulumi.ResourceOptions,
        tags: dict[str, str],
        event_pattern: pulumi.Input[str] | None = None,
        schedule_expression: str | None = None,
    ) -> None:
        rule = aws.cloudwatch.EventRule(
            name, event_pattern=event_pattern, schedule_expression=schedule_expression, tags=tags, opts=opts
        )
        aws.cloudwatch.EventTarget(name, rule=rule.name, arn=self.function.arn, opts=opts)
        aws.lambda_.Permission(
            name,
            action="lambda:InvokeFunction",
            function=self.function.name,
            principal="events.amazonaws.com",
            source_arn=rule.arn,
            opts=opts,
        )
