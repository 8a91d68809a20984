"""What every bucket of the program carries (the model bucket, infra/storage.py; the SSM transfer bucket,
infra/operator_access.py): a name S3 takes, objects owned by the bucket's owner (no ACLs), public access blocked
four ways, SSE-KMS under a customer key with bucket keys, and a policy refusing plain HTTP. Versioning and lifecycle
are each bucket's own."""

from __future__ import annotations

import json

import pulumi
import pulumi_aws as aws

BUCKET_NAME_MAX = 63


def checked_bucket_name(name: str) -> str:
    if len(name) > BUCKET_NAME_MAX:
        raise ValueError(f"bucket name {name!r} exceeds {BUCKET_NAME_MAX} characters; shorten the datacenter name")
    return name


def tls_only_policy(bucket_arn: str) -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "DenyPlainHttp",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "s3:*",
                    "Resource": [bucket_arn, f"{bucket_arn}/*"],
                    "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                }
            ],
        }
    )


def make_private(prefix: str, bucket: aws.s3.Bucket, key_arn: pulumi.Input[str]) -> None:
    """`bucket`'s children `<prefix>-ownership`, `<prefix>-public-access`, `<prefix>-encryption` and
    `<prefix>-tls-only`: the bucket is never public, encrypted under `key_arn` and reached over TLS only."""
    on_bucket = pulumi.ResourceOptions(parent=bucket)
    aws.s3.BucketOwnershipControls(
        f"{prefix}-ownership",
        bucket=bucket.bucket,
        rule={"object_ownership": "BucketOwnerEnforced"},
        opts=on_bucket,
    )
    aws.s3.BucketPublicAccessBlock(
        f"{prefix}-public-access",
        bucket=bucket.bucket,
        block_public_acls=True,
        block_public_policy=True,
        ignore_public_acls=True,
        restrict_public_buckets=True,
        opts=on_bucket,
    )
    aws.s3.BucketServerSideEncryptionConfiguration(
        f"{prefix}-encryption",
        bucket=bucket.bucket,
        rules=[
            {
                "apply_server_side_encryption_by_default": {"sse_algorithm": "aws:kms", "kms_master_key_id": key_arn},
                "bucket_key_enabled": True,  # one KMS call per object, not per GET range of a 100 GB checkpoint
            }
        ],
        opts=on_bucket,
    )
    aws.s3.BucketPolicy(
        f"{prefix}-tls-only",
        bucket=bucket.bucket,
        policy=bucket.arn.apply(tls_only_policy),
        opts=on_bucket,
    )
