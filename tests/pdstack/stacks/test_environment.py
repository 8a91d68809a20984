"""Every subcommand that reads stacks finds them the same way: `--stacks DIR`, by default the stacks/ of the project
holding the working directory, and `--env NAME`; one loader (pdstack.stacks.environment) with one strictness."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.local.inventory import render_inventory
from pdstack.local.topology import topology_of
from pdstack.stacks.environment import EnvironmentLoadError, default_stacks_dir, find_project, load_environment
from tests.support import REPO

SUBFOLDERS = [".", "stacks", "roles/pdserve/tasks", "infra", "deep/er/still"]


def edit(path: Path, key: str, change: dict[str, object]) -> None:
    raw = yaml.safe_load(path.read_text())
    raw["config"][key].update(change)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project whose stacks differ from the repository's in values the commands print."""
    root = tmp_path_factory.mktemp("copy") / "project"
    root.mkdir()
    shutil.copy(REPO / "Pulumi.yaml", root)
    for folder in ("stacks", "infra", "policy", "roles"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "deep" / "er" / "still").mkdir(parents=True)
    edit(root / "stacks" / "Pulumi.prod-control.yaml", "pdstack:capacity", {"requests_per_second": 2})
    edit(root / "stacks" / "Pulumi.local-control.yaml", "pdstack:canary", {"interval_s": 33})
    return root


def run(cwd: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("COLUMNS", "500")  # usage errors come in a box: no wrapping inside the message
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_the_project_is_found_by_walking_up_to_pulumi_yaml(project: Path) -> None:
    for sub in SUBFOLDERS:
        assert find_project(project / sub) == project
        assert default_stacks_dir(project / sub) == project / "stacks"
    assert find_project(project.parent) is None


@pytest.mark.parametrize("sub", SUBFOLDERS)
def test_every_subcommand_finds_the_projects_stacks_from_any_folder(
    project: Path, sub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = project / sub
    code, out, err = run(here, monkeypatch, "validate", "--json")
    assert code == 0, out + err
    assert len(json.loads(out)["stacks"]) == 12

    code, out, err = run(here, monkeypatch, "validate", "--env", "prod", "--json")
    assert (code, json.loads(out)["stacks"]) == (0, ["prod-control", "prod-decode-us-west-2", "prod-prefill-us-east-1"])

    code, out, err = run(here, monkeypatch, "plan", "--env", "prod", "--json")
    assert code == 0, out + err
    assert json.loads(out)["workload"]["requests_per_second"] == 2  # the copy's value, not the repository's 3

    code, out, err = run(here, monkeypatch, "canary", "policy", "--env", "local")
    assert (code, json.loads(out)["interval_s"]) == (0, 33)

    code, out, err = run(here, monkeypatch, "synth", "--env", "local", "--json")
    assert code == 0, out + err
    assert [s["stack"] for s in json.loads(out)["stacks"]] == ["local-control", "local-dc1", "local-dc2"]

    code, out, err = run(here, monkeypatch, "local", "inventory")
    assert code == 0, out + err
    assert out == render_inventory(topology_of(list(load_environment(project / "stacks", "local").stacks)))


def test_stacks_option_names_another_folder_from_anywhere(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacks = str(project / "stacks")
    assert run(tmp_path, monkeypatch, "canary", "policy", "--stacks", stacks)[1].count('"interval_s":33') == 1
    code, out, _ = run(tmp_path, monkeypatch, "plan", "--env", "prod", "--stacks", stacks, "--json")
    assert (code, json.loads(out)["workload"]["requests_per_second"]) == (0, 2)
    code, out, _ = run(tmp_path, monkeypatch, "validate", "--stacks", stacks)
    assert code == 0 and out.startswith("ok: 12 stacks valid")


def test_outside_a_project_without_stacks_every_subcommand_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for args in (["validate"], ["plan", "--env", "prod"], ["canary", "policy"], ["synth"], ["local", "inventory"]):
        code, out, err = run(tmp_path, monkeypatch, *args)
        assert code == 2, (args, out, err)
        assert out == ""
        assert f"no such folder: {tmp_path / 'stacks'}" in err, (args, err)


def test_old_spellings_still_work_with_a_deprecation_warning(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stacks = str(project / "stacks")
    code, out, err = run(project.parent, monkeypatch, "canary", "policy", "--stack-dir", stacks)
    assert (code, json.loads(out)["interval_s"]) == (0, 33)
    assert "--stack-dir is deprecated" in err
    code, out, err = run(project.parent, monkeypatch, "plan", "--env", "prod", "--stacks-dir", stacks, "--json")
    assert (code, json.loads(out)["workload"]["requests_per_second"]) == (0, 2)
    assert "--stacks-dir is deprecated" in err
    code, out, err = run(project.parent, monkeypatch, "local", "inventory", "--project", str(project))
    assert code == 0 and out.startswith("# Rendered by `pdstack local inventory`")
    assert "--project is deprecated" in err
    code, out, err = run(project.parent, monkeypatch, "validate", stacks)
    assert code == 0 and "validate PATH... is deprecated" in err


def test_one_strictness_an_invalid_environment_does_not_load_anywhere(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prod file that passes on its own but breaks the environment (a CIDR overlap): validate, plan, canary and
    synth all refuse prod, with the same problem; other environments still load."""
    copy = tmp_path / "project"
    shutil.copytree(project, copy)
    edit(copy / "stacks" / "Pulumi.prod-decode-us-west-2.yaml", "pdstack:datacenter", {"cidr": "10.31.128.0/17"})
    problem = "pdstack:datacenter.cidr: 10.31.0.0/16 overlaps 10.31.128.0/17"
    with pytest.raises(EnvironmentLoadError, match="overlaps"):
        load_environment(copy / "stacks", "prod")
    assert load_environment(copy / "stacks", "dev").name == "dev"
    code, out, _ = run(copy, monkeypatch, "validate", "--env", "prod")
    assert code == 1 and problem in out
    for args in (["plan", "--env", "prod"], ["canary", "policy", "--env", "prod"]):
        code, _, err = run(copy / "infra", monkeypatch, *args)
        assert code == 2 and "overlaps" in err, (args, err)
    code, out, err = run(copy, monkeypatch, "synth", "--stack", "prod-control", "--json")
    assert code == 1 and "overlaps" in json.loads(out)["errors"][0]
    code, out, _ = run(copy, monkeypatch, "canary", "policy", "--env", "local")
    assert code == 0


def test_synth_env_and_stack_must_agree(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run(project, monkeypatch, "synth", "--env", "dev", "--stack", "prod-control")
    assert code == 2 and "not stacks of environment dev: Pulumi.prod-control.yaml" in err
    code, _, err = run(project, monkeypatch, "synth", "--env", "nope")
    assert code == 2 and "no stack files Pulumi.nope-*.yaml" in err
