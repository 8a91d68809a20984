"""The local images' tag: a hash of the sources the build reads, so `up` rebuilds exactly when they change; and one
build of an image at a time."""

from __future__ import annotations

import secrets
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdstack.local import nodes
from pdstack.local.images import built, source_hash


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


@pytest.mark.slow
def test_two_builders_of_one_image_build_it_once() -> None:
    """Two lanes of `make test` (or two `up`s) wanting the same image: one builds, the other waits and finds it."""
    image = f"localhost/pdstack-buildlock:src-{secrets.token_hex(4)}"
    builds: list[str] = []

    def build() -> None:
        builds.append(threading.current_thread().name)
        time.sleep(1)  # long enough for the other builder to arrive while this one holds the lock
        empty = subprocess.run(["tar", "-c", "-T", "/dev/null"], capture_output=True, check=True).stdout
        subprocess.run(["podman", "import", "-", image], input=empty, capture_output=True, check=True)

    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda _: built(image, build), range(2)))
        assert results == [image, image] and len(builds) == 1, builds
        assert nodes.image_exists(image)
    finally:
        subprocess.run(["podman", "rmi", "-f", image], capture_output=True, check=False)
