"""The environment's image repositories (in the control plane's region): immutable tags, scanned, KMS-encrypted."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

IMAGES = ("gateway", "scheduler", "prefill", "decode")
KEEP_IMAGES = 50


@dataclass(frozen=True)
class ImageRegistryArgs:
    env: str
    key_arn: pulumi.Input[str]
    tags: Mapping[str, str]
    images: Sequence[str] = IMAGES


class ImageRegistry(pulumi.ComponentResource):
    repositories: dict[str, aws.ecr.Repository]

    def __init__(self, name: str, args: ImageRegistryArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:registry:ImageRegistry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.repositories = {}
        for image in args.images:
            repo = aws.ecr.Repository(
                f"{name}-{image}",
                name=f"pdstack-{args.env}/{image}",
                image_tag_mutability="IMMUTABLE",  # a canary's version means one image, forever
                image_scanning_configuration={"scan_on_push": True},
                encryption_configurations=[{"encryption_type": "KMS", "kms_key": args.key_arn}],
                tags=dict(args.tags),
                opts=child,
            )
            aws.ecr.LifecyclePolicy(
                f"{name}-{image}",
                repository=repo.name,
                policy=json.dumps(
                    {
                        "rules": [
                            {
                                "rulePriority": 1,
                                "description": f"keep the last {KEEP_IMAGES} images (rollback targets)",
                                "selection": {
                                    "tagStatus": "any",
                                    "countType": "imageCountMoreThan",
                                    "countNumber": KEEP_IMAGES,
                                },
                                "action": {"type": "expire"},
                            }
                        ]
                    }
                ),
                opts=pulumi.ResourceOptions(parent=repo),
            )
            self.repositories[image] = repo
        self.register_outputs({"urls": {k: r.repository_url for k, r in self.repositories.items()}})
