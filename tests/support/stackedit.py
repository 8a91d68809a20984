"""Edits of a copy of the example stacks (the stacks_dir fixture), and what `pdstack validate` says of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdstack.stacks.validate import validate


def edit(path: Path, change: Any) -> None:
    """Apply `change(config_block)` to a stack file, writing it back as YAML."""
    doc = yaml.safe_load(path.read_text())
    change(doc["config"])
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def problems_of(folder: Path) -> list[str]:
    return [str(p) for p in validate([folder]).problems]
