"""The local images' tag: a hash of the sources the build reads, so `up` rebuilds exactly when they change."""

from __future__ import annotations

import subprocess
from pathlib import Path

from pdstack.local.images import source_hash


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_hash_follows_what_the_build_would_read(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "app.py").write_text("print('v1')\n")
    (tmp_path / ".gitignore").write_text("*.pyc\n")
    git(tmp_path, "add", ".")
    first = source_hash(tmp_path, ["serving"])
    assert len(first) == 12 and source_hash(tmp_path, ["serving"]) == first

    (tmp_path / "serving" / "cache.pyc").write_bytes(b"\0")
    (tmp_path / "elsewhere.py").write_text("x = 1\n")
    assert source_hash(tmp_path, ["serving"]) == first, "ignored files and other folders do not count"

    (tmp_path / "serving" / "new_module.py").write_text("x = 1\n")
    with_new = source_hash(tmp_path, ["serving"])
    assert with_new != first, "an untracked module the build picks up must change the tag"

    (tmp_path / "serving" / "app.py").write_text("print('v2')\n")
    assert source_hash(tmp_path, ["serving"]) not in (first, with_new)

    (tmp_path / "serving" / "app.py").unlink()  # tracked, deleted from the work tree
    assert source_hash(tmp_path, ["serving"]) not in (first, with_new)
