"""Model storage of one datacenter: a versioned, KMS-encrypted S3 bucket that is never public, and optionally
an FSx for Lustre file system linked to it for fast parallel loading of the weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.buckets import checked_bucket_name, make_private
from infra.protection import stateful
from infra.tags import PURPOSE

LUSTRE_PORTS = ((988, 988), (1018, 1023))


@dataclass(frozen=True)
class ModelStorageArgs:
    env: str
    dc: str
    account_id: pulumi.Input[str]
    key_arn: pulumi.Input[str]
    tags: Mapping[str, str]
    vpc_id: pulumi.Input[str]
    lustre_subnet_id: pulumi.Input[str]
    service_cidrs: list[str]
    lustre_capacity_gib: int = 0  # 0: no Lustre; otherwise 1200 or a multiple of 2400 (PERSISTENT_2)


def bucket_name(env: str, dc: str, account_id: str) -> str:
    return checked_bucket_name(f"pdstack-{env}-{dc}-{account_id}")


class ModelStorage(pulumi.ComponentResource):
    bucket: aws.s3.Bucket
    lustre: aws.fsx.LustreFileSystem | None = None

    def __init__(self, name: str, args: ModelStorageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:storage:ModelStorage", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        self.bucket = aws.s3.Bucket(
            f"{name}-models",
            bucket=pulumi.Output.from_input(args.account_id).apply(lambda a: bucket_name(args.env, args.dc, a)),
            tags={**tags, PURPOSE: "model-weights"},
            opts=stateful(child, retain=True),
        )
        make_private(name, self.bucket, args.key_arn)
        on_bucket = pulumi.ResourceOptions(parent=self.bucket)
        aws.s3.BucketVersioning(
            f"{name}-versioning",
            bucket=self.bucket.bucket,
            versioning_configuration={"status": "Enabled"},
            opts=on_bucket,
        )
        aws.s3.BucketLifecycleConfiguration(
            f"{name}-lifecycle",
            bucket=self.bucket.bucket,
            rules=[
                {
                    "id": "expire-replaced-weights",
                    "status": "Enabled",
                    "filter": {"prefix": ""},
                    "noncurrent_version_expiration": {"noncurrent_days": 30},
                    "abort_incomplete_multipart_upload": {"days_after_initiation": 7},
                }
            ],
            opts=on_bucket,
        )
        if args.lustre_capacity_gib:
            self.lustre = self._lustre(name, args, child)
        self.register_outputs({"bucket": self.bucket.bucket})

    def _lustre(self, name: str, args: ModelStorageArgs, opts: pulumi.ResourceOptions) -> aws.fsx.LustreFileSystem:
        group = aws.ec2.SecurityGroup(
            f"{name}-lustre",
            vpc_id=args.vpc_id,
            description="FSx for Lustre: clients in the service subnets",
            tags=dict(args.tags),
            opts=opts,
        )
        for low, high in LUSTRE_PORTS:
            for i, cidr in enumerate(args.service_cidrs):
                aws.vpc.SecurityGroupIngressRule(
                    f"{name}-lustre-{low}-{i}",
                    security_group_id=group.id,
                    ip_protocol="tcp",
                    from_port=low,
                    to_port=high,
                    cidr_ipv4=cidr,
                    description=f"Lustre from {cidr}",
                    tags={**args.tags, PURPOSE: "lustre"},
                    opts=opts,
                )
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-lustre-{low}-self",
                security_group_id=group.id,
                ip_protocol="tcp",
                from_port=low,
                to_port=high,
                referenced_security_group_id=group.id,
                description="Lustre servers among themselves",
                tags={**args.tags, PURPOSE: "lustre"},
                opts=opts,
            )
        lustre = aws.fsx.LustreFileSystem(
            f"{name}-lustre",
            storage_capacity=args.lustre_capacity_gib,
            subnet_ids=args.lustre_subnet_id,
            deployment_type="PERSISTENT_2",
            per_unit_storage_throughput=250,
            storage_type="SSD",
            kms_key_id=args.key_arn,
            security_group_ids=[group.id],
            data_compression_type="LZ4",
            tags=dict(args.tags),
            opts=opts,
        )
        aws.fsx.DataRepositoryAssociation(
            f"{name}-lustre-models",
            file_system_id=lustre.id,
            file_system_path="/models",
            data_repository_path=self.bucket.bucket.apply(lambda b: f"s3://{b}"),
            s3={
                "auto_import_policy": {"events": ["NEW", "CHANGED", "DELETED"]},
            },
            opts=pulumi.ResourceOptions(parent=lustre),
        )
        return lustre
