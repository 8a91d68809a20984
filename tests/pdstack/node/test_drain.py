"""pdstack/node/drain.py: a node drains with what it last applied, and only then lets its group terminate it."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from pdstack.node.apply import VARS_FILE, PlaybookRun
from pdstack.node.drain import (
    DRAIN_PLAYBOOK,
    TERMINATED,
    WATCH_UNIT,
    DrainError,
    complete_termination,
    drain_node,
    imds_target_state,
    install_termination_watch,
    wait_for_termination,
)
from tests.pdstack.node.test_node_playbook import LOCAL

SHA = "ab" * 32


def applied(state_dir: Path, with_playbook: bool = True) -> Path:
    """A node's state after an apply: the vars file and the bundle it named."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / VARS_FILE).write_text(json.dumps({"pdstack_bundle_sha256": SHA, "pdstack_role": "decode"}))
    bundle = state_dir / "bundles" / SHA
    (bundle / "playbooks").mkdir(parents=True)
    if with_playbook:
        (bundle / DRAIN_PLAYBOOK).write_text("---\n")
    return bundle


def test_a_node_that_never_applied_has_nothing_to_drain(tmp_path: Path) -> None:
    with pytest.raises(DrainError, match="never applied a release"):
        drain_node(tmp_path, runner=lambda run: 0)


def test_the_drain_runs_the_last_bundles_drain_play_with_the_last_applys_variables(tmp_path: Path) -> None:
    bundle = applied(tmp_path)
    runs: list[PlaybookRun] = []
    drain_node(tmp_path, runner=lambda run: runs.append(run) or 0, bin_dir=Path("/venv/bin"))
    (run,) = runs
    assert run.argv[0] == "/venv/bin/ansible-playbook"
    assert run.argv[-1] == str(bundle / DRAIN_PLAYBOOK)
    assert f"@{tmp_path / VARS_FILE}" in run.argv
    assert run.cwd == bundle and run.env["ANSIBLE_ROLES_PATH"] == str(bundle / "roles")


def test_a_failed_drain_play_is_an_error(tmp_path: Path) -> None:
    applied(tmp_path)
    with pytest.raises(DrainError, match="exited 2"):
        drain_node(tmp_path, runner=lambda run: 2)


def test_a_bundle_without_the_drain_play_says_so(tmp_path: Path) -> None:
    applied(tmp_path, with_playbook=False)
    with pytest.raises(DrainError, match="has no playbooks/node_drain"):
        drain_node(tmp_path, runner=lambda run: 0)


def test_the_lifecycle_action_completed_is_the_pools_drain_hook_for_this_instance() -> None:
    """moto serves no CompleteLifecycleAction: botocore's Stubber checks the call against the API model."""
    autoscaling = boto3.client("autoscaling", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(autoscaling) as stub:
        stub.add_response(
            "complete_lifecycle_action",
            {},
            {
                "LifecycleHookName": "pdstack-drain",
                "AutoScalingGroupName": "pdstack-local-dc2-decode",
                "InstanceId": "i-0123456789abcdef0",
                "LifecycleActionResult": "CONTINUE",
            },
        )
        complete_termination(autoscaling, LOCAL, "i-0123456789abcdef0")
        stub.assert_no_pending_responses()


def test_the_watch_waits_until_the_group_chose_the_instance() -> None:
    states = iter([None, "InService", "InService", TERMINATED])
    slept: list[float] = []
    wait_for_termination(lambda: next(states), poll_s=5, sleep=slept.append)
    assert slept == [5, 5, 5]


def test_no_metadata_service_is_no_state() -> None:
    assert imds_target_state("http://127.0.0.1:9", timeout_s=0.5) is None


def test_a_cloud_node_watches_for_its_scale_in_from_the_venv_it_runs(tmp_path: Path) -> None:
    calls: list[list[str]] = []
    install_termination_watch(tmp_path / "state", tmp_path, lambda argv, **_: calls.append(argv))
    unit = (tmp_path / WATCH_UNIT).read_text()
    assert f"ExecStart={tmp_path / 'state' / 'venv' / 'bin' / 'python'} -m pdstack.node watch-termination" in unit
    assert calls == [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", WATCH_UNIT]]
