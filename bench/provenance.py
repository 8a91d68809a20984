"""Where a benchmark's figures come from and go: the commit of the checkout it ran from, and its results files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent.parent


def commit(*paths: str) -> str:
    """The last commit (of `paths`, else of the whole checkout), with a mark when they hold uncommitted changes;
    'unknown' in a snapshot without .git (the benches take --commit there)."""
    scope = ["--", *paths] if paths else []
    head = subprocess.run(
        ["git", "log", "-1", "--format=%h %s", *scope], capture_output=True, text=True, check=False, cwd=ROOT
    )
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", *scope],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    return head.stdout.strip()[:120] + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")


def write_results(output_dir: Path, name: str, report: dict[str, Any], markdown: str) -> None:
    """<output_dir>/<name>-<date>.json and .md, and the markdown on stdout."""
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_dir / f"{name}-{report['date'][:10]}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
