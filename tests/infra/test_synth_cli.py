"""`pdstack synth` end to end through the command line: offline, every stack, verdicts, exit status."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.policy.rules import POLICY_NAMES
from tests.support import REPO


@pytest.fixture
def in_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO / "infra")  # the command finds the project by walking up to Pulumi.yaml


def test_synth_lists_resources_and_passes_the_policies(in_project: None) -> None:
    result = CliRunner().invoke(app, ["synth", "--stack", "prod-decode-us-west-2", "--stack", "local-dc1"])
    assert result.exit_code == 0, result.output
    assert "prod-decode-us-west-2: " in result.output and f"policies: all {len(POLICY_NAMES)} passed" in result.output
    assert "aws:ec2transitgateway/peeringAttachment:PeeringAttachment" in result.output
    assert "local-dc1: nothing to synthesise" in result.output


def test_synth_json_redacts_secrets(in_project: None) -> None:
    result = CliRunner().invoke(app, ["synth", "--stack", "dev-control", "--json"])
    assert result.exit_code == 0, result.output
    stack = json.loads(result.output)["stacks"][0]
    assert stack["violations"] == [] and "secret_values" not in stack["outputs"]
    assert "mock-" not in result.output  # no generated value is printed, not even the mocks' stand-ins
    types = {r["type"] for r in stack["resources"]}
    assert {
        "aws:eks/cluster:Cluster",
        "kubernetes:apps/v1:Deployment",
        "random:index/randomPassword:RandomPassword",
    } <= types


def test_synth_names_the_known_stacks_when_asked_for_an_unknown_one(in_project: None) -> None:
    result = CliRunner().invoke(app, ["synth", "--stack", "prod-nowhere"])
    assert result.exit_code == 2
    assert "no stack 'prod-nowhere'" in result.output and "prod-control" in result.output
