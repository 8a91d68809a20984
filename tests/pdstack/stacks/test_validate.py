"""`pdstack validate`: the examples pass; each mistake is caught, naming file, field and reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdstack.stacks.validate import validate
from tests.support import STACKS
from tests.support.stackedit import edit, problems_of

PDSTACK = [sys.executable, "-m", "pdstack"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDSTACK, *args], capture_output=True, text=True, check=False)


def test_every_example_stack_is_valid() -> None:
    report = validate([STACKS])
    assert report.problems == []
    assert {s.config.environment for s in report.stacks} == {"local", "dev", "staging", "prod"}


def test_cli_accepts_examples_and_lists_environments() -> None:
    result = run_cli("validate", str(STACKS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "prod (3)" in result.stdout and "local (3)" in result.stdout


def test_overlapping_cidrs_across_two_stacks_of_one_environment(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.prod-decode-us-west-2.yaml",
        lambda c: c["pdstack:datacenter"].update(cidr="10.31.128.0/17"),
    )
    found = problems_of(stacks_dir)
    assert found == [
        f"{stacks_dir}/Pulumi.prod-prefill-us-east-1.yaml: pdstack:datacenter.cidr: "
        f"10.31.0.0/16 overlaps 10.31.128.0/17 of {stacks_dir}/Pulumi.prod-decode-us-west-2.yaml"
    ]


def test_same_cidr_in_two_environments_is_fine(stacks_dir: Path) -> None:
    edit(stacks_dir / "Pulumi.dev-control.yaml", lambda c: c["pdstack:datacenter"].update(cidr="10.30.0.0/20"))
    assert problems_of(stacks_dir) == []


def test_link_to_missing_datacenter(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.prod-prefill-us-east-1.yaml",
        lambda c: c["pdstack:datacenter"]["links"][0].update(peer="decode-eu-west-1"),
    )
    found = problems_of(stacks_dir)
    assert (
        f"{stacks_dir}/Pulumi.prod-prefill-us-east-1.yaml: pdstack:datacenter.links[0].peer: no datacenter "
        "'decode-eu-west-1' in environment prod (known: control, decode-us-west-2, prefill-us-east-1)"
    ) in found


def test_unknown_instance_type(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.prod-prefill-us-east-1.yaml",
        lambda c: c["pdstack:datacenter"]["pools"][0].update(instance_type="p5.24xlarge"),
    )
    assert problems_of(stacks_dir) == [
        f"{stacks_dir}/Pulumi.prod-prefill-us-east-1.yaml: pdstack:datacenter.pools[0].instance_type: "
        "unknown instance type 'p5.24xlarge' (known p5 types: p5.48xlarge)"
    ]


def test_efa_on_a_type_without_it(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.dev-prefill-us-east-1.yaml", lambda c: c["pdstack:datacenter"]["pools"][0].update(efa=True)
    )
    assert problems_of(stacks_dir) == [
        f"{stacks_dir}/Pulumi.dev-prefill-us-east-1.yaml: pdstack:datacenter.pools[0].efa: "
        "g6e.xlarge does not support EFA"
    ]


def test_min_above_max(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.prod-decode-us-west-2.yaml",
        lambda c: c["pdstack:datacenter"]["pools"][0].update(min_size=9, desired_size=9, max_size=8),
    )
    assert problems_of(stacks_dir) == [
        f"{stacks_dir}/Pulumi.prod-decode-us-west-2.yaml: pdstack:datacenter.pools[0]: "
        "need min_size <= desired_size <= max_size, got 9 <= 9 <= 8"
    ]


def test_typo_in_a_key_suggests_the_right_one(stacks_dir: Path) -> None:
    def typo(c: dict[str, Any]) -> None:
        pool = c["pdstack:datacenter"]["pools"][0]
        pool["instance_typ"] = pool.pop("instance_type")

    edit(stacks_dir / "Pulumi.staging-decode-us-west-2.yaml", typo)
    found = problems_of(stacks_dir)
    where = f"{stacks_dir}/Pulumi.staging-decode-us-west-2.yaml: pdstack:datacenter.pools[0]"
    assert f"{where}.instance_typ: unknown key (did you mean 'instance_type'?)" in found
    assert f"{where}.instance_type: required key is missing" in found
    assert len(found) == 2, "a file that does not load must not echo as environment-level problems"


def test_string_where_a_number_belongs(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.prod-control.yaml",
        lambda c: c["pdstack:datacenter"]["links"][0].update(bandwidth_gbps="100"),
    )
    assert problems_of(stacks_dir) == [
        f"{stacks_dir}/Pulumi.prod-control.yaml: pdstack:datacenter.links[0].bandwidth_gbps: "
        "Input should be a valid number, got str '100'"
    ]


def test_malformed_yaml_is_a_clear_error_not_a_traceback(stacks_dir: Path) -> None:
    bad = stacks_dir / "Pulumi.dev-control.yaml"
    bad.write_text("config:\n  pdstack:environment: dev\n  pdstack:datacenter: {name: control, cidr: [\n")
    result = run_cli("validate", "--stacks", str(stacks_dir))
    assert result.returncode == 1
    assert result.stderr == ""
    assert result.stdout.startswith(f"{bad}: malformed YAML: line 4, column 1:")
    assert "Traceback" not in result.stdout


def test_json_report_names_file_path_and_reason(stacks_dir: Path) -> None:
    edit(stacks_dir / "Pulumi.local-dc2.yaml", lambda c: c["pdstack:datacenter"]["pools"][0].update(max_size=0))
    result = run_cli("validate", "--json", "--stacks", str(stacks_dir))
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False
    assert report["problems"] == [
        {
            "file": f"{stacks_dir}/Pulumi.local-dc2.yaml",
            "path": "pdstack:datacenter.pools[0].max_size",
            "reason": "Input should be greater than or equal to 1",
        }
    ]


@pytest.mark.parametrize(
    ("file", "change", "expected"),
    [
        (
            "Pulumi.prod-decode-us-west-2.yaml",
            lambda c: c.pop("aws:region"),
            "aws:region: must be set to the datacenter's region 'us-west-2', got None",
        ),
        (
            "Pulumi.prod-decode-us-west-2.yaml",
            lambda c: c["pdstack:datacenter"]["pools"][0].update(instance_type="m7i.xlarge", efa=False),
            "pdstack:datacenter.pools[0].instance_type: a decode pool needs GPUs, and m7i.xlarge has none",
        ),
        (
            "Pulumi.prod-decode-us-west-2.yaml",
            lambda c: c.update({"pdstack:canary": {"interval_s": 30}}),
            "pdstack:canary must be set in the control-plane stack, not in a decode one",
        ),
        (
            "Pulumi.prod-control.yaml",
            lambda c: c["pdstack:capacity"].update(headroom_pct=45),
            "pdstack:capacity.headroom_pct: Input should be less than or equal to 30",
        ),
        (
            "Pulumi.prod-control.yaml",
            lambda c: c["pdstack:canary"].update(steps_pct=[5, 50, 25]),
            "pdstack:canary: steps_pct must rise strictly and end at 100, got [5, 50, 25]",
        ),
        (
            "Pulumi.local-dc1.yaml",
            lambda c: c["pdstack:datacenter"]["links"][0].update(kind="transit_gateway"),
            "pdstack:datacenter.links[0].kind: `emulated` links are for the local environment, and only they are",
        ),
        (
            "Pulumi.local-dc1.yaml",
            lambda c: c.update({"pdstack:environment": "qa"}),
            "pdstack:environment: Input should be 'local', 'dev', 'staging' or 'prod'",
        ),
        (
            "Pulumi.local-dc1.yaml",
            lambda c: c["pdstack:datacenter"].update(cidr="10.210.1.0/33"),
            "pdstack:datacenter.cidr: Input is not a valid IPv4 network",
        ),
        (
            "Pulumi.prod-control.yaml",
            lambda c: c["pdstack:secrets"].pop(),
            "pdstack:secrets lacks metrics-scrape-token: the serving runtime reads gateway-api-keys, "
            "kv-channel-key, scheduler-admin-token, scheduler-identity-key, server-api-token, "
            "ratelimit-store-password, metrics-scrape-token",
        ),
        (
            "Pulumi.prod-control.yaml",
            lambda c: c["pdstack:secrets"].append({"name": "scheduler-instance-token"}),
            "pdstack:secrets: scheduler-instance-token is retired (the scheduler derives each server's own token from "
            "scheduler-identity-key; one token shared by every node let any node act as another)",
        ),
    ],
)
def test_other_mistakes_name_the_field(stacks_dir: Path, file: str, change: Any, expected: str) -> None:
    edit(stacks_dir / file, change)
    assert f"{stacks_dir}/{file}: {expected}" in problems_of(stacks_dir)


def test_environment_needs_prefill_decode_and_one_control(stacks_dir: Path) -> None:
    (stacks_dir / "Pulumi.dev-decode-us-east-2.yaml").unlink()
    found = problems_of(stacks_dir)
    assert "environment dev: needs at least one decode pool" in found
    (stacks_dir / "Pulumi.dev-control.yaml").unlink()
    assert "environment dev: needs exactly one control-plane datacenter, found 0 (none)" in problems_of(stacks_dir)


def test_links_declared_on_both_sides_must_agree(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.prod-decode-us-west-2.yaml",
        lambda c: c["pdstack:datacenter"].update(
            links=[{"peer": "prefill-us-east-1", "kind": "transit_gateway", "bandwidth_gbps": 10, "rtt_ms": 62}]
        ),
    )
    found = problems_of(stacks_dir)
    assert any("pdstack:datacenter.links[0]: disagrees with the link" in p for p in found)


def test_stack_file_name_must_match_its_content(stacks_dir: Path) -> None:
    (stacks_dir / "Pulumi.dev-control.yaml").rename(stacks_dir / "Pulumi.dev-ctl.yaml")
    assert problems_of(stacks_dir) == [
        f"{stacks_dir}/Pulumi.dev-ctl.yaml: stack name 'dev-ctl' does not match environment-datacenter 'dev-control'"
    ]


def test_missing_path_exits_2() -> None:
    result = run_cli("validate", "/nonexistent/stacks")
    assert result.returncode == 2
    assert "no such file or folder: /nonexistent/stacks" in result.stderr


@pytest.mark.parametrize(
    "change",
    [lambda c: c.pop("pdstack:alerting"), lambda c: c["pdstack:alerting"].pop("webhook_url")],
    ids=["no alerting", "no webhook"],
)
def test_a_prod_stack_without_an_alert_receiver_is_refused_naming_the_field(stacks_dir: Path, change: Any) -> None:
    edit(stacks_dir / "Pulumi.prod-control.yaml", change)
    found = problems_of(stacks_dir)
    assert len(found) == 1, found
    assert found[0].startswith(
        f"{stacks_dir}/Pulumi.prod-control.yaml: pdstack:alerting.webhook_url: "
        "a prod environment needs an alert receiver"
    )


def test_a_prod_receiver_may_be_a_pulumi_secret_and_other_environments_need_none(stacks_dir: Path) -> None:
    edit(
        stacks_dir / "Pulumi.prod-control.yaml", lambda c: c["pdstack:alerting"].update(webhook_url={"secure": "v1:x"})
    )
    edit(stacks_dir / "Pulumi.dev-control.yaml", lambda c: c.pop("pdstack:alerting", None))
    assert problems_of(stacks_dir) == []
