"""`pdstack plan` states what an environment's stacks need of the account's service quotas, per region."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.plan.quotas import EIPS, NAT_PER_AZ, STANDARD, TRANSIT_GATEWAYS, VPCS, family_quota, quota_needs
from pdstack.stacks.files import load_stack_file
from tests.support import STACKS


def _needs(*envs: str) -> dict[tuple[str, str], int]:
    stacks = [load_stack_file(p) for env in envs for p in sorted(STACKS.glob(f"Pulumi.{env}-*.yaml"))]
    return {(n.region, n.quota.name): n.needed for n in quota_needs(stacks)}


def test_the_families_count_in_their_own_quotas() -> None:
    assert family_quota("p5.48xlarge").code == family_quota("p5en.48xlarge").code == "ec2/L-417A185B"
    assert family_quota("g6e.xlarge").code == "ec2/L-DB2E81BA"
    assert family_quota("m7i.2xlarge") is STANDARD


def test_prod_needs_per_region() -> None:
    needs = _needs("prod")
    # us-east-1: the control and prefill stacks, each a VPC, a Transit Gateway and a NAT gateway per zone
    assert needs["us-east-1", VPCS.name] == needs["us-east-1", TRANSIT_GATEWAYS.name] == 2
    assert needs["us-east-1", EIPS.name] == 4 and needs["us-east-1", NAT_PER_AZ.name] == 2
    assert needs["us-east-1", STANDARD.name] == 9 * 8  # the control pool at its max_size of m7i.2xlarge
    assert needs["us-west-2", family_quota("p5e.48xlarge").name] == 2 * 8 * 192  # two decode pools of 8 p5e(n)s
    assert needs["us-west-2", VPCS.name] == 1
    assert _needs("dev")["us-east-1", EIPS.name] == 2  # dev: one NAT gateway per stack


def test_environments_in_one_account_exceed_the_default_vpcs() -> None:
    stacks = [load_stack_file(p) for env in ("dev", "staging", "prod") for p in STACKS.glob(f"Pulumi.{env}-*.yaml")]
    vpcs = next(n for n in quota_needs(stacks) if n.region == "us-east-1" and n.quota is VPCS)
    assert vpcs.needed == 6 and vpcs.over_default


def test_plan_reports_the_quotas() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--env", "prod", "--stacks", str(STACKS), "--json"])
    assert result.exit_code in (0, 1), result.output
    quotas = json.loads(result.output)["quotas"]
    assert {"region": "us-east-1", "quota": VPCS.name, "needed": 2, "default": 5} == {
        k: next(q for q in quotas if q["region"] == "us-east-1" and q["quota"] == VPCS.name)[k]
        for k in ("region", "quota", "needed", "default")
    }
    text = runner.invoke(app, ["plan", "--env", "prod", "--stacks", str(STACKS)], env={"COLUMNS": "250"})
    assert "Service quotas" in text.output and "L-417A185B" in text.output
