"""What a benchmark's figures measure: the commit of the checkout it runs from."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent


def commit(*paths: str) -> str:
    """The last commit (of `paths`, else of the whole checkout), with a mark when they hold uncommitted changes;
    'unknown' in a snapshot without .git (the benches take --commit there)."""
    scope = ["--", *paths] if paths else []
    head = subprocess.run(["git", "log", "-1", "--format=%h %s", *scope], capture_output=True, text=True,
                          check=False, cwd=ROOT)  # fmt: skip
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *scope], capture_output=True,
                           text=True, check=False, cwd=ROOT)  # fmt: skip
    return head.stdout.strip()[:120] + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")
