"""The bootstrap against moto over HTTP: a fresh node comes up with its secrets, registry credentials and verified
model and runs the bundle's playbook; a second boot repeats no work; each fault is a BootstrapError naming its
phase, the node Unhealthy in its group, the failure metric written and nothing half-written left in place."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
from pathlib import Path
from typing import Any

import pytest
from botocore.stub import Stubber

from pdstack.node.apply import TASK_TIMES_CALLBACK, TASK_TIMES_ENV, TASK_TIMES_FILE, PlaybookRun
from pdstack.node.loader import BootstrapError, Phase
from pdstack.node.release import ModelFile
from tests.pdstack.node.conftest import MODEL_FILES, Node, pool_certificate
from tests.support.motoserver import ACCOUNT

PHASES = [str(p) for p in Phase]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_fresh_node_comes_up(node: Node) -> None:
    result = node.boot()

    assert (result.instance_id, result.release) == (node.instance_id, "2026-12-06.1")
    # secrets: one file per stack secret the node reads, and the pool's certificate, key and CA; 0600 each
    secrets = node.paths.secrets_dir
    assert sorted(p.name for p in secrets.iterdir() if p.is_file()) == sorted([*node.config.secrets, "scheduler.token"])
    for name in node.config.secrets:
        assert (secrets / name).read_text() == f"value of {name}"
        assert mode(secrets / name) == 0o600
    assert node.scheduler is not None
    assert {p.name: p.read_text() for p in (secrets / "tls").iterdir()} == pool_certificate(node.scheduler)
    # registry: podman's auth file for the images' registry, from ECR's token (moto's: AWS:<account>-auth-token)
    host = f"{ACCOUNT}.dkr.ecr.{node.config.control_region}.amazonaws.com"
    auth = json.loads(node.paths.registry_auth_file.read_text())
    assert auth == {"auths": {host: {"auth": base64.b64encode(f"AWS:{ACCOUNT}-auth-token".encode()).decode()}}}
    assert mode(node.paths.registry_auth_file) == 0o600
    # model: every file in place with the manifest's bytes, every byte counted, nothing else left beside them
    model_dir = Path(node.config.model_dir)
    for path, data in MODEL_FILES.items():
        assert (model_dir / path).read_bytes() == data
    assert not list(model_dir.rglob("*.part"))
    total = sum(map(len, MODEL_FILES.values()))
    assert (result.model.downloaded_bytes, result.model.downloaded_files, result.model.total_bytes) == (
        total,
        len(MODEL_FILES),
        total,
    )
    # apply: the bundle's playbook on this host, from the bundle's venv, with what the bootstrap learnt
    [run] = node.runs
    bundle_dir = node.paths.state_dir / "bundles" / node.record.bundle.sha256
    vars_file = node.paths.state_dir / "apply-vars.json"
    assert run.argv == (
        "/opt/venv/bin/ansible-playbook",
        "--inventory",
        "localhost,",
        "--connection",
        "local",
        "--extra-vars",
        f"@{vars_file}",
        str(bundle_dir / "playbooks" / "node.yml"),
    )
    assert run.env["ANSIBLE_ROLES_PATH"] == str(bundle_dir / "roles")
    assert run.env["ANSIBLE_COLLECTIONS_PATH"] == str(bundle_dir / "collections")
    assert run.env["ANSIBLE_CALLBACKS_ENABLED"] == TASK_TIMES_CALLBACK
    assert run.env[TASK_TIMES_ENV] == str(node.paths.state_dir / TASK_TIMES_FILE)
    assert json.loads(vars_file.read_text()) == {
        "pdstack_environment": "local",
        "pdstack_datacenter": "dc2",
        "pdstack_region": "local",
        "pdstack_pool": "decode",
        "pdstack_role": "decode",
        "pdstack_instance_id": node.instance_id,
        "pdstack_release_name": "2026-12-06.1",
        "pdstack_bundle_sha256": node.record.bundle.sha256,
        "pdstack_images": node.record.images,
        "pdstack_model": {"name": "pdstack-tiny", "revision": "0123abc", "dir": node.config.model_dir},
        "pdstack_secret_files": {name: str(secrets / name) for name in node.config.secrets},
        "pdstack_tls_files": {name: str(secrets / "tls" / name) for name in ("tls.crt", "tls.key", "ca.crt")},
        "container_runtime_auth_file": str(node.paths.registry_auth_file),
        "pdstack_control_region": node.config.control_region,
        "pdstack_aws_endpoint_url": node.config.aws_endpoint_url,
        "pdstack_scheduler_url_parameter": "/pdstack/local/scheduler-url",
        "pdstack_instance_token_file": str(secrets / "scheduler.token"),
        "pdstack_engine_id": node.instance_id,
    }
    # the metric: success, when, what release, the bytes, each phase's seconds
    metrics = node.metrics()
    assert "pdstack_node_bootstrap_failed 0\n" in metrics
    assert "pdstack_node_bootstrap_success_timestamp_seconds " in metrics
    assert 'pdstack_node_bootstrap_release_info{release="2026-12-06.1"} 1' in metrics
    assert f"pdstack_node_bootstrap_model_downloaded_bytes {total}\n" in metrics
    assert list(result.seconds) == PHASES
    for phase in PHASES:
        assert f'pdstack_node_bootstrap_phase_seconds{{phase="{phase}"}} ' in metrics
    assert node.health() == "Healthy"


def test_the_apply_phase_is_split_as_its_play_ran_in_the_metrics(node: Node) -> None:
    def play(run: PlaybookRun) -> int:  # what the task-times callback writes (tests/pdstack/node/test_apply.py)
        pull = {"play": 1, "role": "pdserve", "action": "containers.podman.podman_image", "start": 5.0, "end": 7.5}
        start = {"play": 1, "role": "pdserve", "action": "containers.podman.podman_container", "start": 8, "end": 9}
        Path(run.env[TASK_TIMES_ENV]).write_text(json.dumps([pull, start]))
        return 0

    result = node.boot(runner=play)

    # the times written above are longer than this phase's own seconds: nothing is left for the roles
    assert result.apply_parts == {"image": 2.5, "roles": 0.0, "engine_start": 1.0}
    metrics = node.metrics()
    assert 'pdstack_node_bootstrap_apply_seconds{part="image"} 2.500\n' in metrics
    assert 'pdstack_node_bootstrap_apply_seconds{part="engine_start"} 1.000\n' in metrics
    assert 'pdstack_node_bootstrap_apply_seconds{part="roles"} ' in metrics


def test_a_second_boot_repeats_no_work(node: Node) -> None:
    """Reboot: the bundle and the model are on disk and verified, so nothing is downloaded (their objects are even
    gone); secrets and credentials are read again (a rotated secret arrives with a reboot)."""
    node.boot()
    s3 = node.client("s3")
    keys = [node.record.model.key(f) for f in node.record.model.files] + [node.record.bundle.key]
    s3.delete_objects(Bucket=node.bucket, Delete={"Objects": [{"Key": k} for k in keys]})
    secret = next(iter(node.config.secrets.values()))
    node.client("secretsmanager", node.config.control_region).put_secret_value(SecretId=secret, SecretString="new")

    again = node.boot()

    assert (again.model.downloaded_bytes, again.model.downloaded_files) == (0, 0)
    assert "pdstack_node_bootstrap_model_downloaded_bytes 0\n" in node.metrics()
    assert (node.paths.secrets_dir / next(iter(node.config.secrets))).read_text() == "new"
    assert len(node.runs) == 2


def test_a_file_changed_on_disk_is_fetched_again(node: Node) -> None:
    node.boot()
    shard = Path(node.config.model_dir) / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"\x08" * len(MODEL_FILES[shard.name]))  # same size, other bytes

    again = node.boot()

    assert (again.model.downloaded_files, again.model.downloaded_bytes) == (1, len(MODEL_FILES[shard.name]))
    assert shard.read_bytes() == MODEL_FILES[shard.name]


def test_a_partial_download_resumes(node: Node) -> None:
    """A reboot during the download: the part already there is kept and only the rest is fetched."""
    name = "model-00001-of-00002.safetensors"
    data = MODEL_FILES[name]
    model_dir = Path(node.config.model_dir)
    model_dir.mkdir(parents=True)
    (model_dir / f".{name}.part").write_bytes(data[:100_000])

    result = node.boot()

    assert (model_dir / name).read_bytes() == data
    assert result.model.downloaded_bytes == sum(map(len, MODEL_FILES.values())) - 100_000


def test_a_corrupt_partial_download_restarts(node: Node) -> None:
    name = "model-00001-of-00002.safetensors"
    model_dir = Path(node.config.model_dir)
    model_dir.mkdir(parents=True)
    (model_dir / f".{name}.part").write_bytes(b"\xff" * 1000)

    node.boot()

    assert (model_dir / name).read_bytes() == MODEL_FILES[name]


def expect_failure(node: Node, phase: Phase, *words: str, **kwargs: Any) -> BootstrapError:
    with pytest.raises(BootstrapError) as caught:
        node.boot(**kwargs)
    error = caught.value
    assert error.phase is phase, error
    for word in words:
        assert word in str(error)
    assert node.health() == "Unhealthy"
    metrics = node.metrics()
    assert f'pdstack_node_bootstrap_failed{{phase="{phase}"}} 1' in metrics
    assert "success_timestamp" not in metrics
    assert node.runs == []  # nothing applied, so nothing started
    return error


def test_a_wrong_model_checksum_fails_the_model_phase(node: Node) -> None:
    model = node.record.model
    bad = ModelFile(path="config.json", size=len(MODEL_FILES["config.json"]), sha256=hashlib.sha256(b"x").hexdigest())
    files = tuple(bad if f.path == bad.path else f for f in model.files)
    node.publish(node.record.model_copy(update={"model": model.model_copy(update={"files": files})}))

    expect_failure(node, Phase.MODEL, "config.json", bad.sha256)

    model_dir = Path(node.config.model_dir)
    assert not (model_dir / "config.json").exists()
    assert not list(model_dir.rglob("*.part"))
    assert not (model_dir / ".pdstack-verified.json").exists()


def test_a_missing_secret_fails_the_secrets_phase(node: Node) -> None:
    secret_id = sorted(node.config.secrets.values())[-1]
    node.client("secretsmanager", node.config.control_region).delete_secret(
        SecretId=secret_id, ForceDeleteWithoutRecovery=True
    )

    error = expect_failure(node, Phase.SECRETS, secret_id, "does not exist")

    assert "value of" not in str(error)
    secrets = node.paths.secrets_dir
    assert not secrets.exists() or not [p for p in secrets.rglob("*") if p.is_file()]  # not one of the others


def test_an_absent_release_record_fails_the_release_phase(node: Node) -> None:
    node.client("ssm", node.config.control_region).delete_parameter(Name=node.config.release_parameter)

    expect_failure(node, Phase.RELEASE, node.config.release_parameter, "does not exist")

    assert not node.paths.state_dir.exists()
    assert not node.paths.secrets_dir.exists()


def test_a_refused_registry_credential_fails_the_registry_phase(node: Node) -> None:
    """ECR refusing the token (moto always grants it: botocore's Stubber plays ECR's AccessDeniedException)."""
    ecr = node.clients("ecr", node.config.control_region)
    stubber = Stubber(ecr)
    stubber.add_client_error("get_authorization_token", "AccessDeniedException", "not authorized", 400)
    stubber.activate()

    def clients(service: str, region: str) -> Any:
        return ecr if service == "ecr" else node.clients(service, region)

    expect_failure(node, Phase.REGISTRY, "AccessDeniedException", node.config.control_region, client=clients)

    assert not node.paths.registry_auth_file.exists()


def test_a_failing_playbook_fails_the_apply_phase(node: Node) -> None:
    def runner(run: Any) -> int:
        return 2

    node.runner = runner  # type: ignore[method-assign]
    expect_failure(node, Phase.APPLY, "ansible-playbook playbooks/node.yml exited 2")


def test_a_corrupt_bundle_fails_the_bundle_phase(node: Node) -> None:
    node.client("s3").put_object(Bucket=node.bucket, Key=node.record.bundle.key, Body=b"not the bundle")

    expect_failure(node, Phase.BUNDLE, node.record.bundle.key, node.record.bundle.sha256)

    assert not list((node.paths.state_dir / "bundles").iterdir())


def test_a_local_node_leaves_scale_in_to_the_local_platform(node: Node) -> None:
    """No metadata service to watch here: `pdstack local scale` drains the node itself (the cloud's node installs
    the termination watch, tests/pdstack/node/test_drain.py)."""
    watched: list[Path] = []
    node.boot(watch_termination=watched.append)
    assert node.config.aws_endpoint_url and watched == []
