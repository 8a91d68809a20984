"""Publishing a release: what the environment's GPU nodes will run from their next boot on.

In this order, so that a node never reads a record whose objects are not there yet: the node bundle (by its sha256,
`bundles/<sha256>.tar.gz`) and the model's files (under `models/<name>/<revision>/`: the prefixes the node role may
read, pdstack.contract.node_lifecycle) into every GPU datacenter's model bucket (each datacenter's nodes may read
only their own), each object skipped when the bucket already holds it with the same size and sha256 (kept as the
object's `sha256` metadata); then the release record, naming the
images by digest, every model file's size and sha256 and each datacenter's bucket, into the environment's SSM
parameter (pdstack.node.release.publish_release: SSM keeps the versions, a rollback publishes an older record again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack.contract.node_lifecycle import BUNDLE_PREFIX, MODEL_PREFIX
from pdstack.model import DatacenterRole
from pdstack.node.loader import file_sha256
from pdstack.node.release import ModelFile, ModelRelease, NodeBundle, ReleaseRecord, publish_release
from pdstack.node.userdata import api_region
from pdstack.stacks.environment import EnvironmentStacks

ClientFactory = Callable[[str, str], Any]  # (service, region) -> a boto3 client
SHA256_METADATA = "sha256"
SKIP_FILES = {".pdstack-verified.json"}  # a node's own note of what it verified, if the folder came from one


@dataclass(frozen=True)
class Published:
    record: ReleaseRecord
    parameter_version: int
    uploaded: dict[str, int]  # bucket -> bytes uploaded (0: everything was there)


def model_bucket(env: str, datacenter: str, account: str) -> str:
    """A datacenter's model bucket, as infra/storage.py names it (a test checks they agree; the toolkit does not
    import the Pulumi program)."""
    return f"pdstack-{env}-{datacenter}-{account}"


def gpu_datacenters(env: EnvironmentStacks) -> dict[str, str]:
    """Each datacenter with GPU pools -> the region its bucket's API is addressed in."""
    out = {}
    for stack in env.configs.values():
        dc = stack.datacenter
        if dc.role is not DatacenterRole.CONTROL:
            out[dc.name] = api_region(dc.region)
    return dict(sorted(out.items()))


def model_manifest(model_dir: Path) -> tuple[ModelFile, ...]:
    """Every file under model_dir, by relative path, with its size and sha256 (hidden files and folders left out)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(model_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if name.startswith(".") or name in SKIP_FILES or not path.is_file():
                continue
            rel = path.relative_to(model_dir).as_posix()
            files.append(ModelFile(path=rel, size=path.stat().st_size, sha256=file_sha256(path)))
    if not files:
        raise ValueError(f"no model files under {model_dir}")
    return tuple(sorted(files, key=lambda f: f.path))


def _present(s3: Any, bucket: str, key: str, size: int, sha256: str) -> bool:
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except s3.exceptions.ClientError:
        return False
    return bool(head["ContentLength"] == size and head.get("Metadata", {}).get(SHA256_METADATA) == sha256)


def _upload(s3: Any, bucket: str, key: str, path: Path, *, size: int, sha256: str) -> int:
    if _present(s3, bucket, key, size, sha256):
        return 0
    s3.upload_file(str(path), bucket, key, ExtraArgs={"Metadata": {SHA256_METADATA: sha256}})
    return size


def publish(
    env: EnvironmentStacks,
    *,
    release: str,
    bundle: Path,
    model_dir: Path,
    model_name: str,
    model_revision: str,
    images: Mapping[str, str],
    buckets: Mapping[str, str],
    clients: ClientFactory,
) -> Published:
    """Upload the bundle and the model into each datacenter's bucket, then write the release record."""
    control = env.control.config
    regions = gpu_datacenters(env)
    unknown = sorted(set(buckets) - set(regions)) + sorted(set(regions) - set(buckets))
    if unknown:
        raise ValueError(f"buckets must name exactly the GPU datacenters {', '.join(regions)} (not {unknown})")
    bundle_sha = file_sha256(bundle)
    node_bundle = NodeBundle(key=f"{BUNDLE_PREFIX}{bundle_sha}.tar.gz", sha256=bundle_sha)
    model = ModelRelease(
        name=model_name,
        revision=model_revision,
        prefix=f"{MODEL_PREFIX}{model_name}/{model_revision}/",
        files=model_manifest(model_dir),
    )
    record = ReleaseRecord(  # checked before anything is uploaded: images by digest, names
        environment=env.name,
        release=release,
        images=dict(images),
        model=model,
        bundle=node_bundle,
        buckets=dict(buckets),
    )
    uploaded = {}
    for dc, bucket in sorted(buckets.items()):
        s3 = clients("s3", regions[dc])
        sent = _upload(s3, bucket, node_bundle.key, bundle, size=bundle.stat().st_size, sha256=bundle_sha)
        for file in model.files:
            sent += _upload(s3, bucket, model.key(file), model_dir / file.path, size=file.size, sha256=file.sha256)
        uploaded[bucket] = sent
    version = publish_release(clients("ssm", api_region(control.datacenter.region)), record)
    return Published(record, version, uploaded)
