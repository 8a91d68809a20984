"""roles/grafana_dashboards on this host, for real: nothing without a Grafana; with one, the dashboards, provider
and data source, idempotently, and a dashboard no longer shipped removed."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.support import REPO
from tests.support.ansible import run_local_playbook

DASHBOARDS = sorted((REPO / "monitoring" / "dashboards").glob("*.json"))


def converge(tmp_path: Path, **variables: str) -> str:
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "grafana",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "roles": ["grafana_dashboards"],
                }
            ]
        )
    )
    settings = {
        "grafana_dashboards_service": "",
        "grafana_dashboards_dir": str(tmp_path / "dashboards"),
        "grafana_dashboards_provisioning_dir": str(tmp_path / "provisioning"),
        **variables,
    }
    result = run_local_playbook(playbook, tmp_path, json.dumps(settings))
    assert result.returncode == 0, result.output
    return " ".join(result.output.split())


def test_a_host_without_grafana_is_left_alone(tmp_path: Path) -> None:
    output = converge(tmp_path)
    assert "no Grafana on this host" in output and "changed=0" in output
    assert not (tmp_path / "dashboards").exists()


def test_dashboards_provider_and_data_source_are_provisioned_once(tmp_path: Path) -> None:
    (tmp_path / "provisioning").mkdir()
    (tmp_path / "dashboards").mkdir()
    (tmp_path / "dashboards" / "retired.json").write_text("{}")
    url = "http://10.210.0.2:9090"
    converge(tmp_path, grafana_dashboards_prometheus_url=url)
    installed = sorted((tmp_path / "dashboards").glob("*.json"))
    assert [p.name for p in installed] == [p.name for p in DASHBOARDS]
    assert all(a.read_text() == b.read_text() for a, b in zip(installed, DASHBOARDS, strict=True))
    provider = yaml.safe_load((tmp_path / "provisioning" / "dashboards" / "pdstack.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == str(tmp_path / "dashboards")
    source = yaml.safe_load((tmp_path / "provisioning" / "datasources" / "pdstack.yml").read_text())
    assert source["datasources"][0]["url"] == url and source["datasources"][0]["type"] == "prometheus"
    assert "changed=0" in converge(tmp_path, grafana_dashboards_prometheus_url=url)
