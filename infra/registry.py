"""The environment's image repositories (in the control plane's region): immutable tags, scanned, KMS-encrypted;
and which of them a GPU node runs (`node_images`: the one definition the repositories, the nodes' pull permission,
their `pdstack:images` tag and the policy `node-images-pullable` follow)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from pdstack.model import Engine, PoolRole

CONTROL_IMAGES = ("gateway", "scheduler")  # the control plane's Deployments (infra/workloads/)
VLLM_IMAGE = "vllm"  # vLLM with pdstack's connector and agent (docs/vllm-images.md), serving.vllm.image
KEEP_IMAGES = 50


def node_images(engine: Engine, role: PoolRole) -> tuple[str, ...]:
    """The images a node of a `role` pool runs under the environment's serving engine: vLLM's image (the engine
    and its agent) with `vllm`, else pdserve's image for its component; a control pool is EKS's, none of ours."""
    if not role.needs_gpu:
        return ()
    return (VLLM_IMAGE,) if engine is Engine.VLLM else (str(role),)


def environment_images() -> tuple[str, ...]:
    """Every repository an environment holds: the control plane's images and each image a node runs under either
    engine. Not only the current engine's: a switch of serving.engine must find its images' repository, and would
    otherwise delete one that holds the rollback targets (ECR refuses to delete a repository holding images)."""
    nodes = dict.fromkeys(image for engine in Engine for role in PoolRole for image in node_images(engine, role))
    return (*CONTROL_IMAGES, *nodes)


def repository_name(env: str, image: str) -> str:
    """`pdstack-<env>/<image>`: what serving.vllm.image and the release's images name after the registry host."""
    return f"pdstack-{env}/{image}"


IMAGES = environment_images()


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
                name=repository_name(args.env, image),
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
