"""The release record: what it refuses, and published to and read from SSM (moto) as the deploy flow and a node do."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from pydantic import ValidationError

from pdstack.contract.components import release_parameter
from pdstack.contract.node_lifecycle import NODE_READABLE_PREFIXES
from pdstack.node.release import (
    ModelFile,
    ModelRelease,
    NodeBundle,
    ReleaseNotFoundError,
    ReleaseRecord,
    publish_release,
    read_release,
    registry_host,
)
from tests.support.motoserver import client

SHA = hashlib.sha256(b"x").hexdigest()
IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/pdstack-staging/vllm:v0.32.0@sha256:{SHA}"


def record(**changes: Any) -> ReleaseRecord:
    values: dict[str, Any] = {
        "environment": "staging",
        "release": "r1",
        "images": {"vllm": IMAGE},
        "model": {
            "name": "m",
            "revision": "abc",
            "prefix": "models/m/abc/",
            "files": [{"path": "config.json", "size": 1, "sha256": SHA}],
        },
        "bundle": {"key": "bundles/r1.tar.gz", "sha256": SHA},
        "buckets": {"decode-us-west-2": "pdstack-staging-decode-us-west-2-123456789012"},
    }
    return ReleaseRecord.model_validate(values | changes)


def test_a_record_round_trips_through_json() -> None:
    one = record()
    assert ReleaseRecord.model_validate_json(one.to_json()) == one
    assert one.bundle.playbook == "playbooks/node.yml"
    assert one.model.key(one.model.files[0]) == "models/m/abc/config.json"


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"images": {"vllm": "123456789012.dkr.ecr.us-east-1.amazonaws.com/pdstack-staging/vllm:v0.32.0"}}, "digest"),
        ({"images": {}}, "at least 1"),
        ({"unknown": 1}, "Extra inputs"),
        ({"buckets": {"Decode_DC": "b"}}, "pattern"),
    ],
)
def test_a_record_refuses(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        record(**changes)


@pytest.mark.parametrize(
    ("field", "model_prefix", "bundle_key"),
    [
        ("model.prefix", "weights/m/abc/", "bundles/r1.tar.gz"),
        ("model.prefix", "", "bundles/r1.tar.gz"),
        ("model.prefix", "bundles/m/abc/", "bundles/r1.tar.gz"),
        ("model.prefix", "models/", "bundles/r1.tar.gz"),
        ("bundle.key", "models/m/abc/", "r1.tar.gz"),
        ("bundle.key", "models/m/abc/", "models/r1.tar.gz"),
        ("bundle.key", "models/m/abc/", "bundles/"),
    ],
)
def test_a_record_outside_what_nodes_may_read_is_refused_naming_the_field(
    field: str, model_prefix: str, bundle_key: str
) -> None:
    model = record().model.model_dump() | {"prefix": model_prefix}
    with pytest.raises(ValidationError, match=rf"{field} .* is not under '(models|bundles)/'") as refused:
        record(model=model, bundle={"key": bundle_key, "sha256": SHA})
    assert ", ".join(NODE_READABLE_PREFIXES) in str(refused.value)


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "a/./b", ""])
def test_a_model_file_stays_inside_the_model_directory(path: str) -> None:
    with pytest.raises(ValidationError):
        ModelFile(path=path, size=1, sha256=SHA)


def test_a_model_lists_each_file_once_and_a_bundle_is_pinned() -> None:
    file = ModelFile(path="a", size=1, sha256=SHA)
    with pytest.raises(ValidationError, match="once"):
        ModelRelease(name="m", revision="r", prefix="", files=(file, file))
    with pytest.raises(ValidationError):
        NodeBundle(key="k", sha256="abc")


def test_the_record_is_frozen() -> None:
    with pytest.raises(ValidationError):
        record().release = "r2"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("image", "host"),
    [
        (IMAGE, "123456789012.dkr.ecr.us-east-1.amazonaws.com"),
        (f"10.210.0.1:5000/pdstack/decode@sha256:{SHA}", "10.210.0.1:5000"),
        (f"localhost/pdstack/decode@sha256:{SHA}", "localhost"),
        (f"library/busybox@sha256:{SHA}", "docker.io"),
        (f"busybox@sha256:{SHA}", "docker.io"),
    ],
)
def test_registry_host(image: str, host: str) -> None:
    assert registry_host(image) == host


def test_publish_versions_and_read_returns_the_current(moto: str) -> None:
    ssm = client(moto, "ssm", "us-west-2")
    first, second = record(release="r1"), record(release="r2")
    assert publish_release(ssm, first) + 1 == publish_release(ssm, second)
    assert read_release(ssm, "staging") == second
    history = ssm.get_parameter_history(Name=release_parameter("staging"))["Parameters"]
    assert [ReleaseRecord.model_validate_json(h["Value"]).release for h in history] == ["r1", "r2"]


def test_an_absent_record_names_its_parameter(moto: str) -> None:
    with pytest.raises(ReleaseNotFoundError, match="/pdstack/dev/release does not exist"):
        read_release(client(moto, "ssm", "eu-west-1"), "dev")


def test_a_record_of_another_environment_is_refused(moto: str) -> None:
    ssm = client(moto, "ssm", "eu-west-2")
    publish_release(ssm, record(), parameter="/pdstack/prod/release")
    with pytest.raises(ValueError, match="environment staging, not prod"):
        read_release(ssm, "prod")
