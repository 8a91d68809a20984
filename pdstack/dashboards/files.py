"""The dashboards as files: monitoring/dashboards/<stem>.json, written and checked against the generator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from pdstack.dashboards import DEFAULT_DIR

from .boards import DASHBOARDS


def as_json(stem: str) -> dict[str, Any]:
    """One dashboard as Grafana's JSON model."""
    encoded: dict[str, Any] = json.loads(json.dumps(DASHBOARDS[stem]().build(), cls=JSONEncoder))
    return encoded


def render() -> dict[str, str]:
    """File name to file text, for every dashboard (stable: sorted keys, so a diff shows what changed)."""
    return {f"{stem}.json": json.dumps(as_json(stem), indent=2, sort_keys=True) + "\n" for stem in DASHBOARDS}


def write(directory: Path = DEFAULT_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def stale(directory: Path = DEFAULT_DIR) -> list[str]:
    """Files missing, differing from the generator's output, or no longer generated."""
    wanted = render()
    found = {path.name for path in directory.glob("*.json")} if directory.is_dir() else set()
    differing = [name for name, text in wanted.items() if name not in found or (directory / name).read_text() != text]
    return sorted(differing + sorted(found - set(wanted)))
