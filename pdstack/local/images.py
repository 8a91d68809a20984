"""The images the local environment serves from: the pdserve runtime and Prometheus, built here and pushed to the
local registry, then handed to the playbooks by digest.

Each image is tagged with a hash of the files it is built from, so `up` rebuilds it only when those files changed
and a second `up` pushes the same digest (the release does not change, so nothing is redeployed).
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pdstack import nodes
from pdstack.local.registry import Registry

RUNTIME_REPOSITORY = "pdstack/pdserve"
PROMETHEUS_REPOSITORY = "pdstack/prometheus"


@dataclass(frozen=True)
class Images:
    """Image references by digest in the local registry."""

    runtime: str
    prometheus: str

    @property
    def release_version(self) -> str:
        """The release label of the runtime image: its digest, shortened."""
        return "sha-" + self.runtime.rsplit(":", 1)[1][:12]


def source_hash(root: Path, paths: list[str]) -> str:
    """A hash over the files under `paths` that git tracks or would track (names and contents), 12 hex digits.

    Untracked files count (a new module the build picks up must change the tag); ignored ones (caches, build
    output) do not; a tracked file deleted from the work tree drops out."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *paths],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    digest = hashlib.sha256()
    for name in sorted(set(listed) - {b""}):
        path = root / name.decode()
        if path.is_file():
            digest.update(name + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def build_runtime_image(project: Path) -> str:
    """The pdserve runtime image (serving/build-image.sh), tagged by the hash of serving/."""
    image = f"localhost/pdserve:src-{source_hash(project, ['serving'])}"
    if not nodes.image_exists(image):
        _run(["bash", str(project / "serving" / "build-image.sh"), image])
        remove_older_builds(image)
    return image


def build_prometheus_image(project: Path) -> str:
    """Prometheus from Debian's package on the debootstrap base (roles/prometheus/files/Containerfile)."""
    context = project / "roles" / "prometheus" / "files"
    image = f"localhost/pdstack-prometheus:src-{source_hash(project, ['roles/prometheus/files'])}"
    if not nodes.image_exists(image):
        base = nodes.build_base_image()
        _run(["podman", "build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}",
              "--build-arg", f"DEBIAN_MIRROR={nodes.host_mirror()}", "-t", image, str(context)])  # fmt: skip
        remove_older_builds(image)
    return image


def remove_older_builds(image: str) -> None:
    """Untag the earlier `src-*` builds of the image's repository (the registry keeps what was deployed)."""
    repository = image.rsplit(":", 1)[0]
    listed = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}", repository],
                            capture_output=True, text=True, check=False).stdout.split()  # fmt: skip
    older = [tag for tag in listed if tag != image and tag.startswith(f"{repository}:src-")]
    if older:
        subprocess.run(["podman", "rmi", *older], capture_output=True, check=False)


def build_and_push(project: Path, registry: Registry) -> Images:
    runtime = build_runtime_image(project)
    prometheus = build_prometheus_image(project)
    return Images(
        runtime=registry.push(runtime, RUNTIME_REPOSITORY, runtime.rsplit(":", 1)[1]),
        prometheus=registry.push(prometheus, PROMETHEUS_REPOSITORY, prometheus.rsplit(":", 1)[1]),
    )


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise nodes.NodeError(f"{' '.join(argv)} failed: {(result.stdout + result.stderr).strip()[-2000:]}")
