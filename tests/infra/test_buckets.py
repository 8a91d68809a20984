"""The program's two buckets, the datacenter's model bucket (infra/storage.py) and its SSM transfer bucket
(infra/operator_access.py), are made private by one builder (infra/buckets.py): the same children with the
names and properties they had when each wrote its own (the URNs `pulumi up` knows them by), and only their own
versioning and lifecycle beside them."""

from __future__ import annotations

import json

import pytest

from infra.buckets import tls_only_policy
from pdstack.synth.synthesis import Synthesis, synthesize
from tests.support import STACKS

DC = "decode-us-east-2"
BUCKET = "aws:s3/bucket:Bucket"
# the bucket's resource name -> the prefix of its children's names, and the children of its own
BUCKETS = {
    f"{DC}-models": (
        DC,
        {"BucketVersioning": "versioning", "BucketLifecycleConfiguration": "lifecycle"},
    ),
    f"{DC}-transfer": (f"{DC}-transfer", {"BucketLifecycleConfiguration": "lifecycle"}),
}
PRIVATE = {
    "BucketOwnershipControls": "ownership",
    "BucketPublicAccessBlock": "public-access",
    "BucketServerSideEncryptionConfiguration": "encryption",
    "BucketPolicy": "tls-only",
}


@pytest.fixture(scope="module")
def graph() -> Synthesis:
    return synthesize(STACKS / f"Pulumi.dev-{DC}.yaml")


def _children(graph: Synthesis, bucket_name: str) -> dict[str, dict[str, object]]:
    [bucket] = [b for b in graph.of_type(BUCKET) if b.name == bucket_name]
    return {f"{c.type.rsplit(':', 1)[1]} {c.name}": c.inputs for c in graph.children_of(bucket)}


@pytest.mark.parametrize("bucket_name", sorted(BUCKETS))
def test_each_bucket_keeps_its_childrens_names_and_parent(graph: Synthesis, bucket_name: str) -> None:
    prefix, own = BUCKETS[bucket_name]
    expected = {f"{kind} {prefix}-{suffix}" for kind, suffix in (PRIVATE | own).items()}
    assert set(_children(graph, bucket_name)) == expected
    [bucket] = [b for b in graph.of_type(BUCKET) if b.name == bucket_name]
    for child in graph.children_of(bucket):
        assert child.urn.endswith(f"aws:s3/bucket:Bucket${child.type}::{child.name}")


@pytest.mark.parametrize("bucket_name", sorted(BUCKETS))
def test_each_bucket_is_private_encrypted_and_tls_only_as_before(graph: Synthesis, bucket_name: str) -> None:
    prefix, _ = BUCKETS[bucket_name]
    children = _children(graph, bucket_name)
    assert children[f"BucketOwnershipControls {prefix}-ownership"]["rule"] == {"objectOwnership": "BucketOwnerEnforced"}
    block = children[f"BucketPublicAccessBlock {prefix}-public-access"]
    assert {k: v for k, v in block.items() if k != "bucket"} == {
        "blockPublicAcls": True,
        "blockPublicPolicy": True,
        "ignorePublicAcls": True,
        "restrictPublicBuckets": True,
    }
    [rule] = children[f"BucketServerSideEncryptionConfiguration {prefix}-encryption"]["rules"]  # type: ignore[misc]
    assert rule["bucketKeyEnabled"] is True
    assert rule["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "aws:kms"
    assert rule["applyServerSideEncryptionByDefault"]["kmsMasterKeyId"]
    policy = json.loads(str(children[f"BucketPolicy {prefix}-tls-only"]["policy"]))
    arn = policy["Statement"][0]["Resource"][0]
    assert policy == json.loads(tls_only_policy(arn))
