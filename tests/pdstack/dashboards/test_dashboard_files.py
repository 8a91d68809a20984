"""The committed Grafana dashboards: what the generator writes, and valid against Grafana's dashboard schema.

Validation: grafana-foundation-sdk's models are generated from Grafana's schema; a file is valid when decoding it
into those models (dashboard, panels, variables; each target as a Prometheus query) and encoding it again gives
the same JSON, so no key is unknown to the schema and none has a value of the wrong shape for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard, prometheus
from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.dashboards.files import DEFAULT_DIR, render, stale
from pdstack.dashboards.promql import expand, metric_names, panels

FILES = sorted(DEFAULT_DIR.glob("*.json"))


def reencoded(model: Any) -> Any:
    return json.loads(json.dumps(model, cls=JSONEncoder))


def schema_problems(document: dict[str, Any]) -> list[str]:
    problems = []
    if reencoded(dashboard.Dashboard.from_json(document)) != document:
        problems.append("dashboard: keys or values outside Grafana's dashboard schema")
    for panel in document.get("panels", []):
        for target in panel.get("targets", []):
            if reencoded(prometheus.Dataquery.from_json(target)) != target:
                problems.append(f"{panel.get('title')}: target outside the Prometheus query schema: {target}")
    return problems


def test_committed_files_are_the_generator_output() -> None:
    assert stale() == [], "run `pdstack dashboards` and commit monitoring/dashboards"
    assert [path.name for path in FILES] == sorted(render())


def test_check_command_reports_a_stale_file(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["dashboards", "--dir", str(tmp_path)]).exit_code == 0
    assert runner.invoke(app, ["dashboards", "--dir", str(tmp_path), "--check"]).exit_code == 0
    (tmp_path / "kv.json").write_text("{}")
    checked = runner.invoke(app, ["dashboards", "--dir", str(tmp_path), "--check"])
    assert checked.exit_code == 1 and "kv.json" in checked.output


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_dashboard_validates_against_grafanas_schema(path: Path) -> None:
    document = json.loads(path.read_text())
    assert schema_problems(document) == []
    assert document["uid"].startswith("pdstack-") and document["title"]
    for panel in document["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]


def test_the_validation_catches_a_misspelt_field() -> None:
    document = json.loads(FILES[0].read_text())
    document["panels"][0]["gridpos"] = document["panels"][0].pop("gridPos")
    document["panels"][1]["targets"][0]["exprr"] = document["panels"][1]["targets"][0].pop("expr")
    assert len(schema_problems(document)) == 2


def test_dashboard_uids_are_unique() -> None:
    uids = [json.loads(path.read_text())["uid"] for path in FILES]
    assert len(set(uids)) == len(uids) == 4


def test_every_panel_names_metrics_and_its_queries_expand() -> None:
    for path in FILES:
        for title, exprs in panels(json.loads(path.read_text())):
            assert set().union(*map(metric_names, exprs)), (path.name, title)
            assert all("$" not in expand(expr) for expr in exprs)


def test_metric_names_skip_functions_labels_and_keywords() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, version) (rate(a_bucket{job="x", b=~"$y"}[5m]))) '
        "/ on (instance) group_left () vllm:b offset 1m > bool 2e3 or vector(0)"
    )
    assert metric_names(expr) == {"a_bucket", "vllm:b"}
