"""Real Prometheus and Alertmanager (Debian's binaries) on loopback with the configurations the roles render: what the
alert-delivery tests run against. They start them with tests.support.process.Daemon, and the webhook receiver standing
in for the operator's pager is tests.support.webhook.Webhook."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdstack.contract.components import ALERTMANAGER_API
from tests.support import REPO
from tests.support.ansible import run_local_playbook

CONTRACT_VARS = REPO / "playbooks" / "vars" / "contract" / "local.yml"
ALERTS = REPO / "monitoring" / "alerts.yml"


def render(tmp_path: Path, inventory: dict[str, Any], variables: dict[str, Any]) -> Path:
    """Render roles/prometheus's and roles/alertmanager's templates with Ansible (the contract's local variables,
    then `variables`) into tmp_path/prometheus.yml and tmp_path/alertmanager.yml."""
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inventory))
    templates = {"prometheus": "prometheus.yml", "alertmanager": "alertmanager.yml"}
    tasks = [
        {
            "name": f"render {role}",
            "ansible.builtin.template": {
                "src": str(REPO / "roles" / role / "templates" / f"{name}.j2"),
                "dest": str(tmp_path / name),
                "mode": "0600",
            },
        }
        for role, name in templates.items()
    ]
    (tmp_path / "render.yml").write_text(
        yaml.safe_dump(
            [
                {
                    "name": "render",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "vars_files": [str(REPO / "roles" / role / "defaults" / "main.yml") for role in templates],
                    "tasks": tasks,
                }
            ]
        )
    )
    inventory = str(tmp_path / "inventory.yml")
    result = run_local_playbook(
        tmp_path / "render.yml", tmp_path, f"@{CONTRACT_VARS}", json.dumps(variables), inventory=inventory
    )
    assert result.returncode == 0, result.output
    return tmp_path


def fast_rules(folder: Path) -> Path:
    """monitoring/alerts.yml with every `for:` removed: the same expressions, firing on their first true evaluation."""
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)
    folder.mkdir(exist_ok=True)
    (folder / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    return folder


def severity_of(alertname: str) -> str:
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alertname:
                return str(rule["labels"]["severity"])
    raise KeyError(alertname)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout} s: {what}")


def post_alert(alertmanager: str, alertname: str, **labels: str) -> None:
    """An alert as Prometheus posts it (labels incl. the rule's severity, no end: Alertmanager keeps it firing)."""
    alert = {
        "labels": {"alertname": alertname, "severity": severity_of(alertname), **labels},
        "annotations": {"summary": f"{alertname} (test)"},
    }
    response = httpx.post(f"{alertmanager}{ALERTMANAGER_API}/alerts", json=[alert], timeout=5)
    assert response.status_code == 200, response.text


def create_silence(alertmanager: str, matchers: dict[str, str], minutes: int = 10) -> str:
    now = time.time()
    body = {
        "matchers": [{"name": k, "value": v, "isRegex": False, "isEqual": True} for k, v in matchers.items()],
        "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 1)),
        "endsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 60 * minutes)),
        "createdBy": "tests/alerting",
        "comment": "silenced by the test",
    }
    response = httpx.post(f"{alertmanager}{ALERTMANAGER_API}/silences", json=body, timeout=5)
    assert response.status_code == 200, response.text
    return str(response.json()["silenceID"])


def alert_state(alertmanager: str, alertname: str, **labels: str) -> dict[str, Any]:
    """Alertmanager's view of one alert: its status (state, silencedBy, inhibitedBy)."""
    matchers = [f'alertname="{alertname}"', *(f'{k}="{v}"' for k, v in labels.items())]
    filters = [("filter", m) for m in matchers]
    response = httpx.get(f"{alertmanager}{ALERTMANAGER_API}/alerts", params=filters, timeout=5)
    response.raise_for_status()
    found = response.json()
    assert len(found) == 1, found
    return dict(found[0]["status"])
