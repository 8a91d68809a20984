"""The release record: what an environment's GPU nodes run, the one document a node joining by itself reads.

The deploy flow publishes it as JSON in the SSM parameter the contract names per environment
(`pdstack.contract.components.release_parameter`, `/pdstack/<env>/release`); every `put` overwrites it, so SSM keeps
its versions (`aws ssm get-parameter-history`) and a rollback is publishing the previous one again. A node reads it at
every boot (pdstack/node/bootstrap.py), so a replaced or added instance runs the *current* release, never whatever
was newest when its launch template was made.

It names everything by content: images by digest, model files by size and sha256, the node bundle (the roles and
playbooks the node applies to itself, and the wheels it runs them with) by sha256. Model files and the bundle are read
from the node's own datacenter's bucket (`buckets`): every datacenter has its own model bucket (infra/storage.py),
and its nodes may read only that one.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdstack.contract.components import release_parameter
from pdstack.contract.node_lifecycle import BUNDLE_PREFIX, MODEL_PREFIX, NODE_READABLE_PREFIXES
from pdstack.model.base import Name

SHA256 = re.compile(r"^[0-9a-f]{64}$")
# repository[:tag]@sha256:<64 hex>: a tag may stay for people to read, the digest is what is pulled
IMAGE_BY_DIGEST = re.compile(r"^(?P<repository>[a-z0-9][^@\s]*)@sha256:[0-9a-f]{64}$")
Sha256 = Annotated[str, Field(pattern=SHA256.pattern)]
# Standard SSM parameters hold 4 KB, advanced ones 8 KB: a model of a few hundred files needs the advanced tier
PARAMETER_TIER_LIMIT = {"Standard": 4096, "Advanced": 8192}


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _relative_path(path: str) -> str:
    if any(part in ("", ".", "..") for part in path.split("/")) or "\\" in path:
        raise ValueError(f"{path!r} must be a relative path inside the model directory, without . or ..")
    return path


class ModelFile(Frozen):
    path: str = Field(min_length=1, description="relative to the model's prefix and to the node's model directory")
    size: int = Field(ge=0)
    sha256: Sha256

    _path = field_validator("path")(_relative_path)


class ModelRelease(Frozen):
    name: str = Field(min_length=1)
    revision: str = Field(min_length=1, description="e.g. the Hugging Face commit the files were taken from")
    prefix: str = Field(description="key prefix of the files in each datacenter's bucket, e.g. models/<name>/<rev>/")
    files: tuple[ModelFile, ...] = Field(min_length=1)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        if prefix.startswith("/") or (prefix and not prefix.endswith("/")):
            raise ValueError(f"prefix {prefix!r} must be empty or end with / and not start with /")
        return prefix

    @model_validator(mode="after")
    def _unique(self) -> ModelRelease:
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("model files must be listed once each")
        return self

    def key(self, file: ModelFile) -> str:
        return f"{self.prefix}{file.path}"

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


class NodeBundle(Frozen):
    """A tar.gz of `playbooks/` and `roles/` (what the node applies to itself) and `wheels/` (pdstack, its
    dependencies and ansible-core, installed offline into the node's venv by pdstack/node/loader.py)."""

    key: str = Field(min_length=1)
    sha256: Sha256
    playbook: str = Field(default="playbooks/node.yml", description="the play the node runs, inside the bundle")

    _playbook = field_validator("playbook")(_relative_path)


class ReleaseRecord(Frozen):
    environment: Name
    release: str = Field(min_length=1, max_length=128, description="e.g. 2026-12-06.1 or a git describe")
    images: dict[str, str] = Field(min_length=1, description="component -> image reference pinned by digest")
    model: ModelRelease
    bundle: NodeBundle
    buckets: dict[Name, str] = Field(min_length=1, description="datacenter -> its model bucket")

    @model_validator(mode="after")
    def _readable_by_nodes(self) -> ReleaseRecord:
        # the node role may read only these prefixes of its bucket (infra/node_pool.py): a record naming objects
        # elsewhere would fail on every node with AccessDenied, so it is refused where it is made and where it is read
        for field, key, prefix in (
            ("model.prefix", self.model.prefix, MODEL_PREFIX),
            ("bundle.key", self.bundle.key, BUNDLE_PREFIX),
        ):
            if not key.startswith(prefix) or key == prefix:
                raise ValueError(
                    f"{field} {key!r} is not under {prefix!r}: a node may read only "
                    f"{', '.join(NODE_READABLE_PREFIXES)} of its datacenter's bucket"
                )
        return self

    @field_validator("images")
    @classmethod
    def _by_digest(cls, images: dict[str, str]) -> dict[str, str]:
        loose = [f"{component}: {ref}" for component, ref in images.items() if not IMAGE_BY_DIGEST.match(ref)]
        if loose:
            raise ValueError(f"images must be pinned by digest (repository@sha256:<64 hex>): {', '.join(loose)}")
        return images

    def bucket(self, datacenter: str) -> str:
        try:
            return self.buckets[datacenter]
        except KeyError:
            raise KeyError(
                f"release {self.release} names no bucket for datacenter {datacenter} (it has: "
                f"{', '.join(sorted(self.buckets))})"
            ) from None

    def to_json(self) -> str:
        return self.model_dump_json(exclude_defaults=False)


def registry_host(image: str) -> str:
    """The registry an image reference is pulled from: its first component when that names a host (a dot, a port
    or localhost), else Docker Hub (as podman resolves it without short-name aliases)."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


class ReleaseNotFoundError(LookupError):
    """The environment's release parameter does not exist (nothing published yet, or the wrong environment)."""

    def __init__(self, parameter: str) -> None:
        super().__init__(f"no release record: SSM parameter {parameter} does not exist")
        self.parameter = parameter


def publish_release(ssm: Any, record: ReleaseRecord, parameter: str | None = None) -> int:
    """Write `record` as its environment's current release (at the contract's parameter unless another is named);
    returns the parameter's new version."""
    value = record.to_json()
    tier = next((t for t, limit in PARAMETER_TIER_LIMIT.items() if len(value.encode()) <= limit), None)
    if tier is None:
        raise ValueError(
            f"release record of {len(value.encode())} bytes exceeds SSM's {PARAMETER_TIER_LIMIT['Advanced']}"
        )
    answer = ssm.put_parameter(
        Name=parameter or release_parameter(record.environment),
        Value=value,
        Type="String",
        Overwrite=True,
        Tier=tier,
        Description=f"pdstack release record of environment {record.environment} (pdstack/node/release.py)",
    )
    return int(answer["Version"])


def read_release(ssm: Any, environment: str, parameter: str | None = None) -> ReleaseRecord:
    """The environment's current release (from the contract's parameter, or the one node.json names);
    ReleaseNotFoundError naming the parameter when there is none."""
    name = parameter or release_parameter(environment)
    try:
        answer = ssm.get_parameter(Name=name)
    except ssm.exceptions.ParameterNotFound:
        raise ReleaseNotFoundError(name) from None
    record = ReleaseRecord.model_validate_json(answer["Parameter"]["Value"])
    if record.environment != environment:
        raise ValueError(f"{name} holds a release of environment {record.environment}, not {environment}")
    return record
