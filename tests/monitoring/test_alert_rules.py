"""The alerting rules: valid for Prometheus, and each alert fires (and stays quiet) as its promtool unit test says."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support import REPO

MONITORING = REPO / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = sorted((MONITORING / "tests").glob("*.yml"))
PROMTOOL = shutil.which("promtool")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is not installed: apt-get install prometheus"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, check=False, cwd=MONITORING)


def alert_names() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


def test_rules_are_valid_prometheus_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_firing() -> None:
    fired: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            fired |= {t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    assert alert_names() - fired == set(), "alerts without a unit test that expects them to fire"


def test_the_symptoms_operators_hunt_first_are_covered() -> None:
    wanted = {
        "PdstackTimeoutsRising",
        "PdstackKVTransferFailures",
        "PdstackKVTransferSlow",
        "PdstackContainerRestarting",
        "PdstackRolloutErrorRate",
        "PdstackThroughputBelowPlan",
        "PdstackClockSkew",
    }
    assert wanted <= alert_names()


def test_a_broken_threshold_makes_the_unit_tests_fail(tmp_path: Path) -> None:
    """The unit tests can fail: with the timeout threshold raised to 50 % the firing case no longer fires."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "alerts.yml").write_text(RULES.read_text().replace("> 0.02", "> 0.5"))
    for path in RULE_TESTS:
        (tmp_path / "tests" / path.name).write_text(path.read_text())
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "test", "rules", *(str(tmp_path / "tests" / p.name) for p in RULE_TESTS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "PdstackTimeoutsRising" in result.stdout + result.stderr
