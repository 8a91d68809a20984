"""What pdstack renders for roles/vllm_engine (pdstack/vllm/deploy.py): the committed playbooks/vars/vllm/<env>.yml
are what the stacks render, and filling the placeholders gives exactly pdstack.vllm.command's command lines for a node,
with each secret going to the container whose command line reads it."""

from __future__ import annotations

import pytest
import yaml

from pdstack.contract.files import environment_serving
from pdstack.model import Engine, KvConnector, PoolRole
from pdstack.vllm.command import API_SERVER, VLLM_PYTHON, agent_args, engine_args, engine_env
from pdstack.vllm.deploy import PLACEHOLDERS, VARS_DIR, ansible_vars, main, render
from tests.support import REPO, STACKS

ENVS = ("local", "dev", "staging", "prod")


@pytest.mark.parametrize("env", ENVS)
def test_the_committed_vllm_vars_are_what_the_stacks_render_to(env: str) -> None:
    committed = (REPO / VARS_DIR / f"{env}.yml").read_text()
    assert committed == render(env, environment_serving(STACKS, env)), "run `python -m pdstack.vllm.deploy`"


def test_the_render_command_reports_nothing_stale() -> None:
    assert main(["--project", str(REPO), "--check"]) == 0


def fill(words: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for word in words:
        filled = word
        for placeholder, value in values.items():
            filled = filled.replace(placeholder, value)
        out.append(filled)
    return out


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
@pytest.mark.parametrize("side", [PoolRole.PREFILL, PoolRole.DECODE])
def test_filled_placeholders_give_vllm_commands_lines(env: str, side: PoolRole) -> None:
    serving = environment_serving(STACKS, env)
    stack = yaml.safe_load((REPO / VARS_DIR / f"{env}.yml").read_text())["vllm_engine_stack"]
    values = dict(zip(PLACEHOLDERS, ["10.1.2.3", "http://10.0.0.9:8100", "r4", f"{side}-n1-abcd"], strict=True))
    rendered = stack["sides"][str(side)]
    engine = fill(rendered["engine"]["command"], values)
    # a shell exports the server token as vLLM's API key, then becomes vLLM's API server
    assert rendered["engine"]["entrypoint"] == "/bin/sh" and engine[0] == "-c" and "exec" in engine[1]
    assert engine[3:6] == [VLLM_PYTHON, "-m", API_SERVER] and engine[6:] == list(
        engine_args(serving, side, "10.1.2.3", version="r4")
    )
    assert rendered["engine"]["env"] == engine_env(serving, side, "@ADVERTISE_HOST@")
    agent = fill(rendered["agent"]["command"], values)
    assert agent == [
        "-m",
        "pdserve.cli",
        *agent_args(
            serving,
            side,
            advertise_host="10.1.2.3",
            scheduler_url="http://10.0.0.9:8100",
            version="r4",
            instance_id=f"{side}-n1-abcd",
        ),
    ]
    # The engine reads the KV key (its connector) and the server token (its API key); the agent its own scheduler
    # token and the server token. Nothing else is handed to either.
    assert rendered["engine"]["secret_files"] == ["kv-channel-key", "server-api-token"]
    assert 'export VLLM_API_KEY="$(cat /run/secrets/server.token)"' in engine[1]
    assert sorted(rendered["agent"]["secret_files"]) == ["scheduler-identity-key", "server-api-token"]
    assert stack["image"] == serving.vllm.image and stack["vllm_version"] == serving.vllm.version  # type: ignore[union-attr]


def test_a_pdserve_environment_renders_only_its_engine() -> None:
    assert ansible_vars(environment_serving(STACKS, "local")) == {"pdstack_engine": str(Engine.PDSERVE)}


def test_nixl_renders_the_engine_and_no_agent() -> None:
    serving = environment_serving(STACKS, "dev")
    assert serving.vllm is not None
    nixl = serving.model_copy(update={"vllm": serving.vllm.model_copy(update={"kv_connector": KvConnector.NIXL})})
    sides = ansible_vars(nixl)["vllm_engine_stack"]["sides"]
    assert sides["prefill"]["agent"] is None
    assert sides["prefill"]["engine"]["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "@ADVERTISE_HOST@"
