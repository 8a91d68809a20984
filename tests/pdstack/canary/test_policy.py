"""The canary policy's warm-up and failure limit: defaults, validation, and the JSON deploy.yml reads."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.model import Canary
from tests.support import STACKS


def test_by_default_a_canary_warms_up_a_minute_and_needs_two_failures_in_a_row() -> None:
    policy = Canary()
    assert (policy.warmup_s, policy.failure_limit) == (60.0, 2)


def test_no_warm_up_and_a_failure_limit_of_one_are_allowed() -> None:
    policy = Canary.model_validate({"warmup_s": 0, "failure_limit": 1})
    assert (policy.warmup_s, policy.failure_limit) == (0, 1)


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ({"failure_limit": 0}, "failure_limit\n  Input should be greater than or equal to 1"),
        ({"warmup_s": -1}, "warmup_s\n  Input should be greater than or equal to 0"),
        ({"warmup_s": 7200}, "warmup_s\n  Input should be less than or equal to 3600"),
        ({"failure_limit": "2"}, "failure_limit\n  Input should be a valid integer"),
        ({"warmup": 30}, "warmup\n  Extra inputs are not permitted"),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field(setting: dict[str, object], problem: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Canary.model_validate(setting)
    assert problem in str(refused.value)


def test_the_local_policy_deploy_reads_warms_up_one_interval_and_allows_one_failed_window() -> None:
    result = CliRunner().invoke(app, ["canary", "policy", "--stacks", str(STACKS), "--env", "local"])
    assert result.exit_code == 0, result.output
    policy = json.loads(result.output)
    assert (policy["steps_pct"][0], policy["interval_s"]) == (20, 20)
    assert (policy["warmup_s"], policy["failure_limit"]) == (20, 2)
