"""How operators reach a datacenter's GPU nodes: SSM Session Manager, no key pair and no bastion.

The AWS inventory connects with the `amazon.aws.aws_ssm` connection plugin (inventories/aws/group_vars/nodes.yml):
a session document that runs each session as the node OS's own user (`admin` on Debian 12's official images), and a
bucket the plugin moves files through (every module Ansible runs, so module arguments too). The plugin presigns each
object's URL on the controller and the node fetches or uploads it with curl: the nodes need no S3 permission, only
the controller does (s3:PutObject, GetObject, DeleteObject, ListBucket, GetBucketLocation on this bucket, and
kms:GenerateDataKey / kms:Decrypt on the datacenter key that encrypts it).

The bucket is not versioned (policy s3-buckets-protected holds it to that): the plugin deletes each object once it
is moved, and a versioned bucket would keep every module's arguments in its history. Objects an interrupted run left
expire after a day.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.buckets import checked_bucket_name, make_private
from infra.protection import stateful
from infra.tags import PURPOSE
from pdstack.policy.core import TRANSFER_PURPOSE

NODE_USER = "admin"  # the login user of Debian's official cloud images (cloud-init's default user there)
LEFTOVER_DAYS = 1


def transfer_bucket_name(env: str, dc: str, account_id: str) -> str:
    """`pdstack-<env>-<dc>-<account>-ssm`: what inventories/aws/group_vars/nodes.yml composes from each host."""
    return checked_bucket_name(f"pdstack-{env}-{dc}-{account_id}-ssm")


def session_document_name(env: str, dc: str) -> str:
    """What inventories/aws/group_vars/nodes.yml names as ansible_aws_ssm_document."""
    return f"pdstack-{env}-{dc}-session"


def session_document(user: str = NODE_USER) -> str:
    """A Standard_Stream session document that runs the session as `user` (Session Manager's run-as)."""
    return json.dumps(
        {
            "schemaVersion": "1.0",
            "description": f"pdstack: a shell on a GPU node as {user} (Ansible's aws_ssm connection, operators)",
            "sessionType": "Standard_Stream",
            "inputs": {
                "runAsEnabled": True,
                "runAsDefaultUser": user,
                "idleSessionTimeout": "20",
            },
        },
        indent=2,
    )


@dataclass(frozen=True)
class OperatorAccessArgs:
    env: str
    dc: str
    account_id: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    tags: Mapping[str, str]


class OperatorAccess(pulumi.ComponentResource):
    bucket: aws.s3.Bucket
    document: aws.ssm.Document

    def __init__(self, name: str, args: OperatorAccessArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:access:OperatorAccess", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        self.document = aws.ssm.Document(
            f"{name}-session",
            name=session_document_name(args.env, args.dc),
            document_type="Session",
            document_format="JSON",
            content=session_document(),
            tags=tags,
            opts=child,
        )
        self.bucket = aws.s3.Bucket(
            f"{name}-transfer",
            bucket=pulumi.Output.from_input(args.account_id).apply(
                lambda a: transfer_bucket_name(args.env, args.dc, a)
            ),
            force_destroy=True,  # it holds nothing but files in flight
            tags={**tags, PURPOSE: TRANSFER_PURPOSE},
            opts=stateful(child),  # protected, not retained: it holds nothing but files in flight
        )
        make_private(f"{name}-transfer", self.bucket, args.key_arn)
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-transfer-lifecycle",
            bucket=self.bucket.bucket,
            rules=[
                {
                    "id": "expire-leftovers",
                    "status": "Enabled",
                    "filter": {"prefix": ""},
                    "expiration": {"days": LEFTOVER_DAYS},
                    "abort_incomplete_multipart_upload": {"days_after_initiation": LEFTOVER_DAYS},
                }
            ],
            opts=pulumi.ResourceOptions(parent=self.bucket),
        )
        self.register_outputs({"bucket": self.bucket.bucket, "document": self.document.name})
