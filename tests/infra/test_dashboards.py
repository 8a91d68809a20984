"""The dashboards as ConfigMaps for the cloud's Grafana: one per committed file, labelled for the sidecar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from infra.dashboards import DASHBOARDS_DIR, SIDECAR_LABEL, dashboard_config_maps
from pdstack.synth.synthesis import Synthesis

DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def test_one_labelled_config_map_per_dashboard_file() -> None:
    maps = dashboard_config_maps("pdstack-prod")
    files = sorted(DASHBOARDS_DIR.glob("*.json"))
    assert len(maps) == len(files) == 4
    for spec, path in zip(maps, files, strict=True):
        meta = spec["metadata"]
        assert meta["labels"][SIDECAR_LABEL] == "1" and meta["namespace"] == "pdstack-prod"
        assert DNS_1123.match(meta["name"]) and len(meta["name"]) <= 63
        assert spec["data"] == {path.name: path.read_text()}
        assert json.loads(spec["data"][path.name])["uid"].startswith("pdstack-")


def test_an_empty_dashboards_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pdstack dashboards"):
        dashboard_config_maps("ns", tmp_path)


def test_the_control_stack_ships_them_in_its_namespace(graphs: dict[str, Synthesis]) -> None:
    shipped = {
        c.inputs["metadata"]["name"]: c.inputs
        for c in graphs["prod-control"].of_type("kubernetes:core/v1:ConfigMap")
        if c.inputs["metadata"].get("labels", {}).get(SIDECAR_LABEL) == "1"
    }
    wanted = dashboard_config_maps("pdstack-prod")
    assert sorted(shipped) == [spec["metadata"]["name"] for spec in wanted]
    for spec in wanted:
        made = shipped[spec["metadata"]["name"]]
        assert made["data"] == spec["data"]
        assert {k: made["metadata"][k] for k in ("namespace", "labels", "annotations")} == {
            k: spec["metadata"][k] for k in ("namespace", "labels", "annotations")
        }
