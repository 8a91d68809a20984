"""The GitHub Actions templates users copy: valid YAML, the right triggers, stacks in dependency order, promotion
gated environment by environment, the policy pack on every preview and up, drift checked without changes."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml

from tests.support import REPO

TEMPLATES = REPO / "ci-templates"
STACKS = {p.name[len("Pulumi.") : -len(".yaml")] for p in (REPO / "stacks").glob("Pulumi.*.yaml")}
CLOUD_STACKS = {s for s in STACKS if not s.startswith("local-")}


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((TEMPLATES / name).read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the bare key `on` as true
    return data


def steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return job.get("steps", [])


def pulumi_steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in steps(job) if str(s.get("uses", "")).startswith("pulumi/actions@")]


def order(jobs: dict[str, Any]) -> list[str]:
    """Jobs in an order that respects `needs`; fails on a cycle or an unknown dependency."""
    done: list[str] = []
    while len(done) < len(jobs):
        ready = [n for n, j in jobs.items() if n not in done and set(_needs(j)) <= set(done)]
        assert ready, f"cycle or unknown job among {set(jobs) - set(done)}"
        done += sorted(ready)
    return done


def _needs(job: dict[str, Any]) -> list[str]:
    needs = job.get("needs", [])
    return [needs] if isinstance(needs, str) else list(needs)


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("*.yml")))
def test_every_workflow_is_valid_yaml_with_runnable_jobs(name: str) -> None:
    workflow = load(name)
    assert workflow["on"] and workflow["jobs"]
    for job_name, job in workflow["jobs"].items():
        assert "runs-on" in job or "uses" in job, job_name
        order(workflow["jobs"])


def test_pull_requests_preview_every_cloud_stack_with_the_policy_pack() -> None:
    workflow = load("pulumi-preview.yml")
    assert "pull_request" in workflow["on"]
    preview = workflow["jobs"]["preview"]
    assert set(preview["strategy"]["matrix"]["stack"]) == CLOUD_STACKS
    assert _needs(preview) == ["offline"]
    (step,) = pulumi_steps(preview)
    assert step["with"]["command"] == "preview" and step["with"]["policyPacks"] == "policy"
    assert step["with"]["comment-on-pr"] is True
    offline = [s.get("run", "") for s in steps(workflow["jobs"]["offline"])]
    assert any("pdstack synth" in r for r in offline) and any("pdstack validate" in r for r in offline)


def test_a_stage_goes_up_control_then_prefill_then_decode_then_deploys() -> None:
    jobs = load("pulumi-stage.yml")["jobs"]
    assert order(jobs) == ["control", "prefill", "decode", "deploy"]
    assert [_needs(jobs[j]) for j in ("prefill", "decode", "deploy")] == [["control"], ["prefill"], ["decode"]]
    for name in ("control", "prefill", "decode"):
        (step,) = pulumi_steps(jobs[name])
        assert step["with"]["command"] == "up" and step["with"]["policyPacks"] == "policy"
    commands = [s.get("run", "") for s in steps(jobs["deploy"])]
    assert any("playbooks/site.yml" in c for c in commands)
    assert commands.index(next(c for c in commands if "playbooks/deploy.yml" in c)) > commands.index(
        next(c for c in commands if "playbooks/site.yml" in c)
    )
    for playbook in ("site.yml", "deploy.yml"):
        assert (REPO / "playbooks" / playbook).is_file()


def test_the_stage_releases_only_through_deploy_yml_after_site_yml() -> None:
    """Every ansible-playbook the stage runs, in order: site.yml (baseline; serving only on a first install, which
    tests/ci_templates/test_release_path.py checks), then deploy.yml (the canary), both with the release; nothing
    else that could start servers (serving.yml, rollback.yml) and no override making site.yml roll out a release."""
    jobs = load("pulumi-stage.yml")["jobs"]
    playbooks = []
    for job in jobs.values():
        for step in steps(job):
            words = shlex.split(step.get("run", "").replace("${{", "").replace("}}", ""))
            if any(w.endswith("ansible-playbook") for w in words):
                (playbook,) = [w for w in words if w.startswith("playbooks/")]
                playbooks.append(playbook)
                assert "pdstack_site_serving" not in step["run"], step["run"]
                assert "-e" in words and any("release-vars" in w for w in words), step["run"]
    assert playbooks == ["playbooks/site.yml", "playbooks/deploy.yml"]


def test_promotion_runs_dev_then_staging_then_prod_each_gated_on_the_last() -> None:
    workflow = load("pulumi-promote.yml")
    assert workflow["on"]["push"]["branches"] == ["main"]
    jobs = workflow["jobs"]
    assert order(jobs) == ["dev", "staging", "prod"]
    assert _needs(jobs["staging"]) == ["dev"] and _needs(jobs["prod"]) == ["staging"]
    for env, job in jobs.items():
        assert job["uses"] == "./.github/workflows/pulumi-stage.yml"
        assert job["with"]["environment"] == env
        named = set(yaml.safe_load(job["with"]["prefill-stacks"])) | set(yaml.safe_load(job["with"]["decode-stacks"]))
        assert named | {f"{env}-control"} == {s for s in CLOUD_STACKS if s.startswith(f"{env}-")}
        assert all("prefill" in s for s in yaml.safe_load(job["with"]["prefill-stacks"]))
        assert all("decode" in s for s in yaml.safe_load(job["with"]["decode-stacks"]))
    assert workflow["concurrency"]["cancel-in-progress"] is False


def test_drift_detection_refreshes_every_stack_without_changing_it() -> None:
    workflow = load("pulumi-drift.yml")
    assert workflow["on"]["schedule"][0]["cron"]
    job = workflow["jobs"]["drift"]
    assert set(job["strategy"]["matrix"]["stack"]) == CLOUD_STACKS
    (run,) = [s["run"] for s in steps(job) if "pulumi refresh" in s.get("run", "")]
    assert "--preview-only" in run and "--expect-no-changes" in run
    assert not [s for s in pulumi_steps(job) if s.get("with", {}).get("command") in ("up", "destroy")]


def test_the_shared_setup_action_installs_the_program_and_the_policy_pack() -> None:
    action = yaml.safe_load((TEMPLATES / "actions" / "pdstack-setup" / "action.yml").read_text(encoding="utf-8"))
    script = "\n".join(s.get("run", "") for s in action["runs"]["steps"])
    assert "infra/requirements.txt" in script and "policy/requirements.txt" in script
    assert (REPO / "infra" / "requirements.txt").is_file() and (REPO / "policy" / "requirements.txt").is_file()


def _compact(text: object) -> str:
    """`${{ x }}` written without spaces, so that it stays one shell word."""
    return re.sub(r"\$\{\{\s*(.*?)\s*\}\}", r"${{\1}}", str(text))


def _commands(program: str) -> list[tuple[dict[str, Any], list[str]]]:
    """Every `program` command the templates run, as (its step's and job's env, argv); `${{ x }}` stays one word."""
    found = []
    for path in sorted(TEMPLATES.rglob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        jobs = data.get("jobs", {}) if isinstance(data, dict) else {}
        for job in jobs.values():
            for step in steps(job):
                script = _compact(step.get("run", ""))
                for line in script.replace("\\\n", " ").splitlines():
                    argv = shlex.split(line) if program in line else []
                    if argv and argv[0].endswith(f"/{program}"):
                        env = {**data.get("env", {}), **job.get("env", {}), **step.get("env", {})}
                        found.append(({k: _compact(v) for k, v in env.items()}, argv))
    return found


def _option_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]


def _read_by_playbooks() -> str:
    """Everything the playbooks (and the roles and vars they load) template from."""
    files = [*(REPO / "playbooks").rglob("*.yml"), *(REPO / "roles").rglob("*.yml"), *(REPO / "roles").rglob("*.j2")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_every_ansible_command_names_an_inventory_that_exists_and_variables_the_playbooks_read() -> None:
    commands = _commands("ansible-playbook") + _commands("ansible-inventory")
    assert len(commands) >= 3
    read = _read_by_playbooks()
    for env, argv in commands:
        (inventory,) = _option_values(argv, "-i")
        folder = REPO / inventory
        assert folder.is_dir() and [*folder.glob("*.aws_ec2.yml"), *folder.glob("hosts.yml")], inventory
        if inventory == "inventories/aws":  # it lists the environment PDSTACK_ENVIRONMENT names
            assert env.get("PDSTACK_ENVIRONMENT") == "${{inputs.environment}}", argv
        for playbook in (a for a in argv if a.startswith("playbooks/")):
            assert (REPO / playbook).is_file(), playbook
        for extra in _option_values(argv, "-e"):
            if extra.startswith("@"):
                continue  # a vars file the user keeps (the stage's release-vars input)
            name = extra.split("=", 1)[0]
            assert re.search(rf"\b{re.escape(name)}\b", read), f"-e {name}: no playbook or role reads it"
            if name == "pdstack_environment":
                assert extra.split("=", 1)[1] == env.get("PDSTACK_ENVIRONMENT"), "the inventory and -e must agree"


def test_the_setup_action_installs_what_the_aws_inventory_needs() -> None:
    action = yaml.safe_load((TEMPLATES / "actions" / "pdstack-setup" / "action.yml").read_text(encoding="utf-8"))
    script = "\n".join(s.get("run", "") for s in action["runs"]["steps"])
    assert ".[ansible]" in script  # ansible, ansible-core and boto3 at the versions pyproject pins


def test_the_deploy_reaches_the_nodes_the_way_the_inventory_does_without_a_key() -> None:
    """inventories/aws connects through SSM sessions (amazon.aws.aws_ssm), with no key pair: the stage asks for no
    key secret, writes no key file, and checks for the session-manager-plugin the connection drives."""
    nodes = yaml.safe_load((REPO / "inventories" / "aws" / "group_vars" / "nodes.yml").read_text())
    assert nodes["ansible_connection"] == "amazon.aws.aws_ssm"
    stage = load("pulumi-stage.yml")
    assert set(stage["on"]["workflow_call"]["secrets"]) == {"PULUMI_ACCESS_TOKEN"}
    deploy = stage["jobs"]["deploy"]
    assert not [k for k in deploy.get("env", {}) if "KEY" in k]
    assert any("session-manager-plugin" in str(s.get("run", "")) for s in steps(deploy))
    for path in TEMPLATES.rglob("*"):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            assert not re.search(r"SSH_KEY|ssh-key|private_key_file", text), path.name
    readme = (TEMPLATES / "README.md").read_text(encoding="utf-8")
    for permission in ("ssm:StartSession", "s3:PutObject", "s3:GetBucketLocation", "kms:GenerateDataKey"):
        assert permission in readme
