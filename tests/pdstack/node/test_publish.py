"""The node bundle and publishing a release, then the round trip: `pdstack node publish` against moto over HTTP,
and a local decode node's bootstrap reading what it published, every phase through apply's command (the play itself
is not run: tests/pdstack/node/test_node_playbook.py checks it).

The bundles here leave wheels/ out (`--no-wheels`): building them is pip's work against the package index (about
10 s and 93 MB of downloads), the same every time; what pdstack decides of it, the two pip command lines and the
requirements stage 0 installs, is checked as such."""

from __future__ import annotations

import configparser
import hashlib
import json
import tarfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from infra.storage import bucket_name
from pdstack.cli import app
from pdstack.contract.components import scheduler_url_parameter
from pdstack.contract.node_lifecycle import node_role_name
from pdstack.node.apply import CALLBACKS_DIR, TASK_TIMES_CALLBACK, PlaybookRun
from pdstack.node.bootstrap import NodePaths, bootstrap
from pdstack.node.bundle import COLLECTIONS, NODE_PLATFORMS, PLAYBOOK, build_bundle, node_requirements, wheel_commands
from pdstack.node.config import NodeConfig
from pdstack.node.loader import REQUIREMENTS, _plain_members, fetch_bundle
from pdstack.node.publish import model_bucket
from pdstack.node.release import read_release
from tests.pdstack.node.conftest import pool_certificate
from tests.support import REPO, STACKS
from tests.support.joining import MutualTlsService, assume
from tests.support.motoserver import ACCOUNT, CREDENTIALS, client

MODEL = {"config.json": b"{}\n", "weights/model.safetensors": bytes(range(256)) * 300, "tokenizer.json": b"{}"}
DIGEST = "sha256:" + "ef" * 32


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bundle(REPO, "local", tmp_path_factory.mktemp("bundle"), wheels=False).path


def test_the_bundle_is_what_the_loader_accepts_and_the_play_needs(bundle: Path, tmp_path: Path) -> None:
    with tarfile.open(bundle) as tar:
        names = [m.name for m in _plain_members(tar, "bundle")]  # the loader's own check: plain files, inside it
        infos = tar.getmembers()
    assert names == sorted(names)
    assert {(m.uid, m.gid, m.mtime, m.uname) for m in infos} == {(0, 0, 0, "")}
    assert PLAYBOOK in names and "ansible.cfg" in names
    assert "inventories/aws/group_vars/all/stacks.yml" in names
    # the strategy the bundle's ansible.cfg names is in the bundle where that file points (relative to itself)
    config = configparser.ConfigParser()
    config.read_string((REPO / "ansible.cfg").read_text())
    plugins = config["defaults"]["strategy_plugins"].removeprefix("./")
    assert f"{plugins}/{config['defaults']['strategy']}.py" in names
    assert f"{CALLBACKS_DIR}/{TASK_TIMES_CALLBACK}.py" in names  # what apply.py enables for the play
    play = yaml.safe_load((REPO / PLAYBOOK).read_text())
    for role in {entry["role"] for p in play for entry in p.get("roles", [])} | {"serving_node", "model_artifacts"}:
        assert f"roles/{role}/meta/argument_specs.yml" in names, role
        assert f"roles/{role}/tasks/main.yml" in names or role == "serving_node", role
    for collection in COLLECTIONS:
        assert f"collections/ansible_collections/{collection.replace('.', '/')}/MANIFEST.json" in names
    assert not [n for n in names if "/tests/" in n or n.endswith(".pyc")]
    # only the environment's own rendered values
    assert "playbooks/vars/contract/local.yml" in names and "playbooks/vars/contract/prod.yml" not in names
    # reproducible: the same tree gives the same bytes
    again = build_bundle(REPO, "local", tmp_path, wheels=False).path
    assert again.read_bytes() == bundle.read_bytes()


def test_the_wheels_are_pinned_for_the_node() -> None:
    install, download = node_requirements(REPO)
    assert install[:2] == ["pdstack==0.1.0", "pdserve==0.1.0"]
    assert {"ansible-core==2.19.14", "mitogen==0.3.54", "boto3==1.44.8", "botocore==1.44.8"} <= set(install)
    assert not [r for r in install + download if r.startswith("ansible==")]  # the collections come as files
    assert "async-timeout==5.0.1" in download  # Debian 12's Python 3.11.2 needs it, whatever builds the bundle
    assert not [r for r in download if ";" in r]
    sources = ["/s/pdstack", "/s/pdserve"]
    build, fetch = wheel_commands("py", [Path(s) for s in sources], Path("/d.txt"), Path("/w"))
    assert build == ["py", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", "/w", *sources]
    assert fetch[:4] == ["py", "-m", "pip", "download"]
    assert "--only-binary=:all:" in fetch and fetch[fetch.index("--python-version") + 1] == "3.11"
    assert [fetch[i + 1] for i, word in enumerate(fetch) if word == "--platform"] == list(NODE_PLATFORMS)
    assert fetch[-4:] == ["--dest", "/w", "--requirement", "/d.txt"]
    assert REQUIREMENTS == "wheels/requirements.txt"


def test_the_bucket_is_the_one_infra_makes() -> None:
    assert model_bucket("prod", "decode-us-west-2", ACCOUNT) == bucket_name("prod", "decode-us-west-2", ACCOUNT)


def test_a_published_release_bootstraps_a_node(  # noqa: PLR0917 (fixtures)
    bundle: Path,
    moto: str,
    local_config: NodeConfig,
    scheduler: MutualTlsService,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS["aws_secret_access_key"])
    config = local_config.model_copy(update={"aws_endpoint_url": moto, "model_dir": str(tmp_path / "node-model")})
    # what the Pulumi program leaves: each GPU datacenter's bucket, the environment's secrets
    s3 = client(moto, "s3", config.aws_region)
    for dc in ("dc1", "dc2"):
        s3.create_bucket(Bucket=bucket_name("local", dc, ACCOUNT))
    secrets = client(moto, "secretsmanager", config.control_region)
    for name, secret_id in config.secrets.items():
        secrets.create_secret(Name=secret_id, SecretString=f"value of {name}")
    secrets.create_secret(Name=config.tls_secret, SecretString=json.dumps(pool_certificate(scheduler)))
    model_dir = tmp_path / "model"
    for path, data in MODEL.items():
        (model_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / path).write_bytes(data)
    (model_dir / ".pdstack-verified.json").write_text("{}")  # a node's note: not part of the model

    args = ["node", "publish", "--env", "local", "--release", "2026-12-07.1", "--bundle", str(bundle)]
    args += ["--model-dir", str(model_dir), "--model-revision", "0123abc", "--account", ACCOUNT]
    args += ["--image", f"localhost:5000/pdstack-local/decode@{DIGEST}", "--stacks", str(STACKS)]
    args += ["--image", f"prefill=localhost:5000/pdstack-local/prefill@{DIGEST}", "--aws-endpoint-url", moto]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code != 0 and "is not NAME=VALUE" in refused.output  # an image without its component
    args[args.index(f"localhost:5000/pdstack-local/decode@{DIGEST}")] = (
        f"decode=localhost:5000/pdstack-local/decode@{DIGEST}"
    )
    answer = CliRunner().invoke(app, args)
    assert answer.exit_code == 0, answer.output
    size = bundle.stat().st_size + sum(map(len, MODEL.values()))
    assert f"s3://{bucket_name('local', 'dc2', ACCOUNT)}: {size} bytes uploaded" in answer.output
    # published again: everything is there already, the record gets a new version
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and f"s3://{bucket_name('local', 'dc1', ACCOUNT)}: 0 bytes uploaded" in again.output
    assert "version 2 of its record" in again.output

    record = read_release(client(moto, "ssm", config.control_region), "local")
    assert record.bundle.sha256 == hashlib.sha256(bundle.read_bytes()).hexdigest()
    assert sorted(f.path for f in record.model.files) == sorted(MODEL)
    assert record.buckets == {dc: bucket_name("local", dc, ACCOUNT) for dc in ("dc1", "dc2")}

    # the node: every phase against what was published, apply's command recorded instead of run
    runs: list[PlaybookRun] = []

    def recorded(run: PlaybookRun) -> int:
        runs.append(run)
        return 0

    paths = NodePaths(
        secrets_dir=tmp_path / "secrets",
        registry_auth_file=tmp_path / "auth.json",
        textfile_dir=tmp_path / "textfile",
        state_dir=tmp_path / "state",
    )
    # the scheduler it joins, and its instance role's credentials (conftest's)
    client(moto, "ssm", config.control_region).put_parameter(
        Name=scheduler_url_parameter("local"), Value=scheduler.url, Type="String", Overwrite=True
    )
    role = node_role_name("local", config.datacenter, config.pool)
    credentials = assume(client(moto, "sts", config.control_region), role, "i-0123456789abcdef0")
    result = bootstrap(
        config,
        client=lambda service, region: client(moto, service, region),
        identify=lambda: "i-0123456789abcdef0",
        credentials=lambda: credentials,
        runner=recorded,
        paths=paths,
        bin_dir=tmp_path / "venv" / "bin",
    )
    assert result.release == "2026-12-07.1"
    assert result.model.downloaded_bytes == sum(map(len, MODEL.values()))
    for path, data in MODEL.items():
        assert (Path(config.model_dir) / path).read_bytes() == data
    [run] = runs
    bundle_dir = fetch_bundle(s3, record.bucket("dc2"), record.bundle.key, record.bundle.sha256, paths.state_dir)
    assert Path(run.argv[-1]) == bundle_dir / PLAYBOOK and (bundle_dir / PLAYBOOK).is_file()
    assert (Path(run.env["ANSIBLE_COLLECTIONS_PATH"]) / "ansible_collections" / "containers" / "podman").is_dir()
    variables = json.loads((paths.state_dir / "apply-vars.json").read_text())
    assert (variables["pdstack_release_name"], variables["pdstack_bundle_sha256"]) == (
        "2026-12-07.1",
        record.bundle.sha256,
    )
    assert variables["pdstack_images"]["decode"] == f"localhost:5000/pdstack-local/decode@{DIGEST}"
    assert "pdstack_node_bootstrap_failed 0" in (paths.textfile_dir / "pdstack_node_bootstrap.prom").read_text()
