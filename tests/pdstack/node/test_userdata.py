"""The user data a pool boots from: valid `#cloud-config` under EC2's 16 KB for every GPU pool of every example
stack, and the local environment's the cloud's but for the environment's values."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.contract.components import contract, release_parameter, secret_name
from pdstack.model import PoolRole
from pdstack.node import loader
from pdstack.node.config import NodeConfig, SsmAgentPin
from pdstack.node.userdata import USER_DATA_LIMIT, UserDataError, render_user_data
from pdstack.stacks.environment import EnvironmentStacks, load_environment
from tests.support import STACKS

ENVIRONMENTS = ("local", "dev", "staging", "prod")
MOTO = "http://10.210.0.1:5000"
# node.json's fields a prod decode pool's and a local one's differ in: the environment's values
ENVIRONMENT_VALUES = {
    "environment",
    "datacenter",
    "region",
    "aws_region",
    "pool",
    "release_parameter",
    "secrets",
    "tls_secret",
    "model_dir",
    "aws_endpoint_url",
}


@pytest.fixture(scope="module")
def envs() -> dict[str, EnvironmentStacks]:
    return {name: load_environment(STACKS, name) for name in ENVIRONMENTS}


def user_data(envs: dict[str, EnvironmentStacks], stack: str, pool: str, endpoint: str | None = None) -> str:
    env = envs[stack.split("-", 1)[0]]
    return render_user_data(env.stack(stack).config, env.control.config, pool, endpoint)


def parsed(text: str) -> tuple[dict[str, Any], NodeConfig]:
    document = yaml.safe_load(text)
    [node_json] = [f["content"] for f in document["write_files"] if f["path"] == str(loader.NODE_CONFIG)]
    return document, NodeConfig.model_validate_json(node_json)


def gpu_pools(envs: dict[str, EnvironmentStacks]) -> list[tuple[str, str]]:
    return [
        (s.stack_name, p.name)
        for env in envs.values()
        for s in env.stacks
        for p in s.config.datacenter.pools
        if p.role is not PoolRole.CONTROL
    ]


def test_every_gpu_pool_has_user_data_ec2_accepts(envs: dict[str, EnvironmentStacks]) -> None:
    pools = gpu_pools(envs)
    assert len(pools) >= 8
    for stack, pool in pools:
        text = user_data(envs, stack, pool)
        assert text.startswith("#cloud-config\n")
        assert len(text.encode()) < USER_DATA_LIMIT, (stack, pool)
        document, config = parsed(text)
        assert (config.pool, config.aws_endpoint_url) == (pool, None)
        assert document["locale"] is False  # Debian's image and the node containers have no locales to set
        assert set(document["packages"]) == {"python3-boto3", "python3-venv"}


def same_but_for_the_environment(cloud_text: str, local_text: str) -> set[str]:
    """Assert that two pools' user data are one document once the local one's node.json and the names in its header
    are the cloud one's; return the node.json fields whose values differ. The one comparison of a local node's user
    data with a launch template's (here, and against `pdstack synth` in tests/infra/test_node_pool.py)."""
    (cloud_document, cloud), (local_document, local) = parsed(cloud_text), parsed(local_text)
    for entry in local_document["write_files"]:
        if entry["path"] == str(loader.NODE_CONFIG):
            entry["content"] = cloud.to_json()
    assert local_document == cloud_document
    header = [line for line in local_text.splitlines() if line.startswith("#")]
    names = {
        f"pool {local.pool},": f"pool {cloud.pool},",
        f"datacenter {local.datacenter},": f"datacenter {cloud.datacenter},",
        f"environment {local.environment}:": f"environment {cloud.environment}:",
    }
    for local_name, cloud_name in names.items():
        header = [line.replace(local_name, cloud_name) for line in header]
    assert header == [line for line in cloud_text.splitlines() if line.startswith("#")]
    return {k for k, v in local.model_dump().items() if cloud.model_dump()[k] != v}


def test_the_local_user_data_is_the_clouds_but_for_the_environments_values(envs: dict[str, EnvironmentStacks]) -> None:
    """What infra gives prod-decode-us-west-2's template and what a local dc2 decode node boots with (NoCloud):
    with node.json's values and the header's names substituted, the same document."""
    cloud_text = user_data(envs, "prod-decode-us-west-2", "decode-h200")
    local_text = user_data(envs, "local-dc2", "decode", MOTO)
    assert parsed(local_text)[1].aws_endpoint_url == MOTO
    assert parsed(cloud_text)[1].aws_endpoint_url is None
    # what differs is only what the environments differ in (both control planes are addressed in us-east-1:
    # prod's region, and the one the local environment's moto serves)
    assert same_but_for_the_environment(cloud_text, local_text) == ENVIRONMENT_VALUES


def test_node_json_names_what_the_contract_names(envs: dict[str, EnvironmentStacks]) -> None:
    _, config = parsed(user_data(envs, "prod-decode-us-west-2", "decode-h200"))
    control = envs["prod"].control.config
    assert control.serving is not None
    assert config.release_parameter == release_parameter("prod") == "/pdstack/prod/release"
    assert config.secrets == {n: secret_name("prod", n) for n in contract(control.serving).node_secrets()}
    assert config.tls_secret == "pdstack/prod/tls/decode-us-west-2/decode-h200"
    assert (config.region, config.aws_region, config.control_region) == ("us-west-2", "us-west-2", "us-east-1")
    assert config.model_dir == control.serving.model.path
    _, local = parsed(user_data(envs, "local-dc1", "prefill", MOTO))
    assert (local.role, local.region, local.aws_region, local.control_region) == (
        "prefill",
        "local",
        "us-east-1",
        "us-east-1",
    )


def test_the_user_data_carries_stage_0_and_runs_it_at_every_boot(envs: dict[str, EnvironmentStacks]) -> None:
    document, _ = parsed(user_data(envs, "staging-decode-us-west-2", "decode"))
    files = {f["path"]: f for f in document["write_files"]}
    stage0 = files["/usr/local/lib/pdstack/node_loader.py"]
    assert stage0["encoding"] == "gz+b64"
    assert gzip.decompress(base64.b64decode(stage0["content"])).decode() == Path(loader.__file__).read_text()
    unit = files["/etc/systemd/system/pdstack-node-bootstrap.service"]["content"]
    assert f"ExecStart=/usr/bin/python3 /usr/local/lib/pdstack/node_loader.py {loader.NODE_CONFIG}" in unit
    assert "WantedBy=multi-user.target" in unit
    assert document["runcmd"][-1] == "systemctl start --no-block pdstack-node-bootstrap.service"


@pytest.mark.parametrize(
    ("stack", "pool", "words"),
    [("prod-control", "system", "control plane"), ("prod-decode-us-west-2", "nope", "no GPU pool")],
)
def test_no_user_data_for_what_does_not_bootstrap(
    envs: dict[str, EnvironmentStacks], stack: str, pool: str, words: str
) -> None:
    with pytest.raises(UserDataError, match=words):
        user_data(envs, stack, pool)


def test_the_command_prints_it() -> None:
    runner = CliRunner()
    args = ["node", "user-data", "--stacks", str(STACKS), "--stack", "local-dc2", "--pool", "decode"]
    text = runner.invoke(app, [*args, "--aws-endpoint-url", MOTO])
    assert text.exit_code == 0, text.output
    assert text.output.startswith("#cloud-config\n")
    as_json = runner.invoke(app, [*args, "--json"])
    assert json.loads(as_json.output)["release_parameter"] == "/pdstack/local/release"
    refused = runner.invoke(
        app, ["node", "user-data", "--stacks", str(STACKS), "--stack", "local-control", "--pool", "x"]
    )
    assert refused.exit_code == 2


def test_a_cloud_pool_pinning_the_ssm_agent_differs_from_a_local_node_only_in_node_json(
    envs: dict[str, EnvironmentStacks],
) -> None:
    """The SSM agent is the cloud's alone (stage 0 installs it when node.json pins one and names no local AWS): the
    pin is one more node.json value, the document otherwise the local one's."""
    env = envs["prod"]
    pin = SsmAgentPin(version="3.3.1802.0", sha256="a" * 64)
    cloud_text = render_user_data(
        env.stack("prod-decode-us-west-2").config, env.control.config, "decode-h200", None, pin
    )
    local_text = user_data(envs, "local-dc2", "decode", MOTO)
    assert parsed(cloud_text)[1].ssm_agent == pin
    assert parsed(local_text)[1].ssm_agent is None
    assert same_but_for_the_environment(cloud_text, local_text) == ENVIRONMENT_VALUES | {"ssm_agent"}
    assert len(cloud_text.encode()) <= USER_DATA_LIMIT
