"""Customer-managed KMS keys, rotated yearly: one per datacenter for its volumes, bucket and images, and one per
environment (in the control plane) for its secrets."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from infra.protection import stateful

AUTOSCALING_ROLE = "aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"
KEY_USE = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"]


def key_policy(account_id: str, allow_autoscaling: bool) -> str:
    """The account administers the key; Auto Scaling's service-linked role may use it, or encrypted
    launch-template volumes fail to launch with a KMS access error."""
    statements: list[dict[str, Any]] = [
        {
            "Sid": "AccountAdministers",
            "Effect": "Allow",
            "Principal": {"AWS": f"arn:aws:iam::{account_id}:root"},
            "Action": "kms:*",
            "Resource": "*",
        }
    ]
    if allow_autoscaling:
        asg_role = f"arn:aws:iam::{account_id}:role/{AUTOSCALING_ROLE}"
        statements += [
            {
                "Sid": "AutoScalingUses",
                "Effect": "Allow",
                "Principal": {"AWS": asg_role},
                "Action": KEY_USE,
                "Resource": "*",
            },
            {
                "Sid": "AutoScalingGrants",
                "Effect": "Allow",
                "Principal": {"AWS": asg_role},
                "Action": "kms:CreateGrant",
                "Resource": "*",
                "Condition": {"Bool": {"kms:GrantIsForAWSResource": "true"}},
            },
        ]
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


@dataclass(frozen=True)
class ManagedKeyArgs:
    description: str
    alias: str
    account_id: pulumi.Input[str]
    tags: Mapping[str, str]
    allow_autoscaling: bool = True


class ManagedKey(pulumi.ComponentResource):
    key: aws.kms.Key

    def __init__(self, name: str, args: ManagedKeyArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:encryption:ManagedKey", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.key = aws.kms.Key(
            f"{name}-key",
            description=args.description,
            enable_key_rotation=True,
            rotation_period_in_days=365,
            deletion_window_in_days=30,
            policy=pulumi.Output.from_input(args.account_id).apply(lambda a: key_policy(a, args.allow_autoscaling)),
            tags=dict(args.tags),
            opts=stateful(child, retain=True),  # without the key nothing it encrypted can be read
        )
        aws.kms.Alias(f"{name}-alias", name=f"alias/{args.alias}", target_key_id=self.key.key_id, opts=child)
        self.register_outputs({"arn": self.key.arn})
