"""Shared fixtures: the repository's own example stacks, copied so tests may edit them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STACKS = REPO / "stacks"


@pytest.fixture
def stacks_dir(tmp_path: Path) -> Path:
    """A private copy of stacks/ that a test may edit."""
    target = tmp_path / "stacks"
    shutil.copytree(STACKS, target)
    return target
