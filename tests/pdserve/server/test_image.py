"""The runtime image: built from serving/Containerfile on the debootstrap base, it runs `pdserve colocated`."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.kv.settings import KV_PORT
from pdstack.local.images import build_runtime_image
from tests.support import REPO
from tests.support.ports import free_port


def podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def image() -> str:
    """The image, built unless present (serving/build-image.sh; podman installed as scripts/host-setup.sh does)."""
    if shutil.which("podman") is None:
        subprocess.run(["bash", str(REPO / "scripts" / "host-setup.sh")], check=True)
    return build_runtime_image(REPO)  # tagged by serving/'s hash: never an image of older sources


@pytest.fixture
def readable_model(make_checkpoint: Callable[..., Path], tmp_path: Path) -> Iterator[Path]:
    """A copy of the dense checkpoint the container's non-root user can read."""
    target = Path(shutil.copytree(make_checkpoint("dense"), tmp_path / "model"))
    for path in [tmp_path, target, *target.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield target


def test_image_serves_colocated_as_non_root(image: str, readable_model: Path) -> None:
    port = free_port()
    name = f"pdserve-test-{port}"
    podman(
        "run",
        "-d",
        "--rm",
        "--name",
        name,
        "--network",
        "host",
        "-v",
        f"{readable_model}:/model:ro",
        "-e",
        "PDSERVE_MODEL=/model",
        "-e",
        f"PDSERVE_PORT={port}",
        "-e",
        "PDSERVE_HOST=127.0.0.1",
        image,
        "colocated",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        ready = None
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(url + "/health/ready", timeout=2)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert ready is not None and ready.status_code == 200, podman("logs", name, check=False).stderr[-2000:]
        answer = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert podman("exec", name, "id", "-u").stdout.strip() != "0"
        assert (
            podman(
                "exec", name, "python3", "-c", "import importlib.util as u; print(u.find_spec('torch'))"
            ).stdout.strip()
            == "None"
        )
    finally:
        podman("rm", "-f", name, check=False)


def test_image_declares_healthcheck_ports_and_user(image: str) -> None:
    inspected = podman(
        "image", "inspect", image, "--format", "{{.Config.User}}|{{.Config.ExposedPorts}}|{{.Config.Healthcheck}}"
    ).stdout
    user, ports, healthcheck = inspected.strip().split("|")
    assert user == "pdserve"
    assert "8000" in ports and str(KV_PORT) in ports
    assert "/health/ready" in healthcheck
