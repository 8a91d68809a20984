"""Whether a warm `up` may skip its playbooks (#19): what the last converge read, and what it left on the nodes.

`up` converges the nodes with playbooks/site.yml, which takes minutes on this machine even when it changes nothing.
After a converge, `up` records a digest of everything the play reads (the release, the rendered contract, the
inventory, the roles and playbooks, the certificates and secrets it deploys, the model's manifest) and, per node, the
containers left running (name and ID). A later `up` skips the play only when both are the same: a changed input, a
container replaced or gone (a canary deploy, a rollback, one removed by hand, one that crashed for good) or a new
node means the play runs. `pdstack local up --converge` always runs it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pdstack.local.commands import run_captured

Containers = dict[str, list[str]]  # node -> sorted "name id" of its running containers


def inputs_digest(root: Path, inputs: Iterable[Path]) -> str:
    """sha256 over every file given or under a folder given (path relative to `root`, then content), in order; a
    path that does not exist counts as absent."""
    digest = hashlib.sha256()
    for path in sorted({f for p in inputs for f in _files(p)}):
        name = path.relative_to(root) if path.is_relative_to(root) else path
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _files(path: Path) -> list[Path]:
    """The file, or the files under the folder; Python's bytecode caches (the roles' filter plugins make them when
    the play loads them) are not inputs."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return [f for f in path.rglob("*") if f.is_file() and "__pycache__" not in f.parts]


def running_containers(node_names: Iterable[str]) -> Containers:
    """What runs in each node now: nothing on a node that is not there or has no podman yet (a fresh node, before
    its first converge installs it)."""
    found: Containers = {}
    for name in node_names:
        listed = run_captured(["podman", "exec", name, "podman", "ps", "--format", "{{.Names}} {{.ID}}"], check=False)
        lines = listed.stdout.splitlines() if listed.returncode == 0 else []
        found[name] = sorted(line for line in lines if line.strip())
    return found


@dataclass(frozen=True)
class ConvergeRecord:
    path: Path  # .cache/local/converged.json

    def save(self, digest: str, containers: Containers) -> None:
        self.path.write_text(json.dumps({"inputs": digest, "containers": containers}, indent=2) + "\n")

    def unchanged(self, digest: str, containers: Containers) -> bool:
        """The same inputs as the last converge, and every node runs exactly the containers it left."""
        if not self.path.is_file():
            return False
        last = json.loads(self.path.read_text())
        return bool(last.get("inputs") == digest and last.get("containers") == containers)

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)
