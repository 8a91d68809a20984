"""`pdstack --version` and `pdserve --version` print the version their pyproject.toml declares (the installed
console scripts, as a user runs them)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support import REPO

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(("command", "project"), [("pdstack", REPO), ("pdserve", REPO / "serving")])
def test_version_flag_prints_the_declared_version(command: str, project: Path) -> None:
    declared = tomllib.loads((project / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([str(BIN / command), "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, f"{command} {declared}\n"), done.stderr
