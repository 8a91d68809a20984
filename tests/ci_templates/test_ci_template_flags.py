"""Every flag the CI templates pass exists in the program it is passed to, and every Pulumi preview and up runs the
policy pack with the config rendered for its environment from the deployment contract.

Where the flags are looked up: `pulumi` in the flags the installed Pulumi SDK's automation API hands the CLI it
drives (pulumi/automation/*.py; the CLI itself is not installed here), `pdstack` in its own command tree,
`ansible-*` in their --help. The pulumi/actions inputs are that action's (it drives the same automation API); the
ones that become CLI flags are mapped below, and the flag each becomes must exist like any other."""

from __future__ import annotations

import inspect
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pulumi.automation
import pytest
import typer
import yaml

from pdstack.cli import app
from pdstack.contract.components import contract
from pdstack.contract.files import POLICY_CONFIG_DIR, environment_serving, policy_config
from pdstack.stacks.files import load_stack_file
from tests.support import REPO, STACKS

TEMPLATES = REPO / "ci-templates"
BIN = REPO / ".venv" / "bin"
# pulumi/actions inputs that become CLI flags (the automation API option they set, the flag it emits) ...
ACTION_FLAGS = {
    "policyPacks": ("policy_packs", "--policy-pack"),
    "policyPackConfigs": ("policy_pack_configs", "--policy-pack-config"),
}
# ... and those that do not: what to run, where, and the PR comment.
ACTION_ONLY = {"command", "stack-name", "comment-on-pr", "github-token"}
EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def workflows() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, yaml.safe_load(p.read_text(encoding="utf-8"))) for p in sorted(TEMPLATES.rglob("*.yml"))]


def all_steps() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(file, job, step) of every step, composite actions' included."""
    found = []
    for path, data in workflows():
        for job in (data.get("jobs") or {}).values():
            found += [(path, job, step) for step in job.get("steps", [])]
        found += [(path, {}, step) for step in (data.get("runs") or {}).get("steps", [])]
    return found


def commands(program: str) -> list[list[str]]:
    """argv of every `program` command the templates run (`${{ x }}` kept as one word)."""
    found = []
    for _, _, step in all_steps():
        script = EXPRESSION.sub(lambda m: "${{" + m.group(1).replace(" ", "") + "}}", str(step.get("run", "")))
        for line in script.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True) if program in line else []
            for i, word in enumerate(words):
                if word == program or word.endswith(f"/{program}"):
                    found.append(words[i:])
                    break
    return found


def flags_of(argv: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in argv if w.startswith("-") and w != "-"]


def pulumi_sdk_flags() -> set[str]:
    folder = Path(inspect.getfile(pulumi.automation)).parent
    return {f for p in folder.glob("*.py") for f in re.findall(r"""["'](--[a-z][a-z-]*)["']""", p.read_text())}


def pdstack_flags(argv: list[str]) -> set[str]:
    """The options of the pdstack subcommand argv names (and the group's)."""
    command: Any = typer.main.get_command(app)
    opts = {o for p in command.params for o in getattr(p, "opts", [])}
    for word in argv[1:]:
        if word.startswith("-") or word not in getattr(command, "commands", {}):
            break
        command = command.commands[word]
        opts |= {o for p in command.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
    return opts | {"--help"}


def help_flags(program: str) -> set[str]:
    out = subprocess.run([str(BIN / program), "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", out))


def test_the_templates_run_pulumi_pdstack_and_ansible() -> None:
    assert commands("pulumi") and commands("pdstack") and commands("ansible-playbook")


@pytest.mark.parametrize("program", ["pulumi", "pdstack", "ansible-playbook", "ansible-inventory"])
def test_every_flag_passed_on_a_command_line_exists(program: str) -> None:
    runs = commands(program)
    for argv in runs:
        if program == "pulumi":
            known = pulumi_sdk_flags()
        elif program == "pdstack":
            known = pdstack_flags(argv)
        else:
            known = help_flags(program)
        unknown = [f for f in flags_of(argv) if f not in known]
        assert not unknown, f"{' '.join(argv)}: {program} has no {unknown}"


def test_the_flag_lookup_would_catch_a_misspelling() -> None:
    assert "--policy-pack-config" in pulumi_sdk_flags() and "--policy-pack-configs" not in pulumi_sdk_flags()
    synth = pdstack_flags(["pdstack", "synth"])
    assert "--stacks" in synth and "--stack-dirs" not in synth
    assert "--extra-vars" in help_flags("ansible-playbook") and "--extra-var" not in help_flags("ansible-playbook")


def pulumi_action_steps() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    return [(p, j, s) for p, j, s in all_steps() if str(s.get("uses", "")).startswith("pulumi/actions@")]


def test_every_pulumi_action_input_is_one_the_action_takes_and_its_flag_exists() -> None:
    sdk = pulumi_sdk_flags()
    for path, _, step in pulumi_action_steps():
        for name in step.get("with", {}):
            assert name in ACTION_ONLY or name in ACTION_FLAGS, f"{path.name}: pulumi/actions input {name!r}?"
            if name in ACTION_FLAGS:
                option, flag = ACTION_FLAGS[name]
                command = step["with"]["command"]
                assert option in inspect.signature(getattr(pulumi.automation.Stack, command)).parameters
                assert flag in sdk


def environments_of(path: Path, job: dict[str, Any]) -> dict[str, str]:
    """What `${{ inputs.environment }}` / `${{ matrix.environment }}` stand for in the job: {stack: environment}."""
    matrix = job.get("strategy", {}).get("matrix", {})
    if "include" in matrix:
        return {i["stack"]: i["environment"] for i in matrix["include"]}
    assert path.name == "pulumi-stage.yml", path  # called once per environment by pulumi-promote.yml
    promote = yaml.safe_load((TEMPLATES / "pulumi-promote.yml").read_text(encoding="utf-8"))
    return {env: env for env in (j["with"]["environment"] for j in promote["jobs"].values())}


def test_every_preview_and_up_runs_the_policy_pack_with_its_environments_rendered_config() -> None:
    checked = set()
    for path, job, step in pulumi_action_steps():
        given = step.get("with", {})
        if given.get("command") not in ("preview", "up"):
            continue
        assert given["policyPacks"] == "policy"
        stacks = environments_of(path, job)
        listed = job.get("strategy", {}).get("matrix", {}).get("stack")
        if isinstance(listed, list):  # every stack of the matrix has its environment
            assert set(stacks) == set(listed)
        for stack, env in stacks.items():
            if stack != env:
                assert load_stack_file(STACKS / f"Pulumi.{stack}.yaml").config.environment == env, stack
            config = EXPRESSION.sub(env, given["policyPackConfigs"])
            assert Path(config).parent == POLICY_CONFIG_DIR
            rendered = (REPO / config).read_text()
            assert yaml.safe_load(rendered) == policy_config(contract(environment_serving(STACKS, env))), config
            checked.add(env)
    assert checked == {"dev", "staging", "prod"}
