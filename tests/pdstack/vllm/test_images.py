"""The vLLM images' Containerfiles (serving/Containerfile.vllm-cpu, .vllm-gpu) build from what their contexts hold,
pin what they install, run the command lines pdstack renders (pdstack/vllm/command.py), and the GPU one refuses a
base image that is not pinned by digest. No image is built here (serving/build-vllm-image.sh builds the CPU one;
the GPU one is built in the users' CI): these are the checks that need neither podman nor a registry."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib

import pytest

from pdstack.model import IMAGE_BY_DIGEST
from pdstack.vllm.command import API_SERVER, RUN_DIR, VLLM_PYTHON
from pdstack.vllm.lock import LEFT_OUT
from tests.support import REPO

SERVING = REPO / "serving"
CPU = SERVING / "Containerfile.vllm-cpu"
GPU = SERVING / "Containerfile.vllm-gpu"
BUILD_SCRIPT = SERVING / "build-vllm-image.sh"
DIGEST = "sha256:" + "0123456789abcdef" * 4


def instructions(path: str | object) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in (REPO / str(path)).read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def of(path: object, word: str) -> list[str]:
    return [rest for w, rest in instructions(path) if w == word]


def copy_sources(path: object) -> list[str]:
    """What a build takes from its context: COPY sources and RUN --mount=type=bind sources."""
    copied = [src for rest in of(path, "COPY") for src in shlex.split(rest)[:-1] if not src.startswith("--")]
    return copied + re.findall(r"--mount=type=bind,source=([^,\s]+)", " ".join(of(path, "RUN")))


def test_the_cpu_images_copy_sources_are_what_its_build_script_puts_in_the_context() -> None:
    made = set(re.findall(r'"\$CONTEXT/([^"/]+)', BUILD_SCRIPT.read_text()))
    sources = {src.rstrip("/") for src in copy_sources(CPU)}
    assert sources == {"wheels", "vllm-lock.txt", "pdserve-wheel"} and sources <= made - {"Containerfile"}


def test_the_cpu_build_script_passes_every_argument_without_default() -> None:
    """LOCK_SHA256 and PDSERVE_SHA256 key the layer cache on the bind-mounted wheels' content."""
    bare = {rest for rest in of(CPU, "ARG") if "=" not in rest}
    passed = set(re.findall(r'--build-arg "([A-Z0-9_]+)=', BUILD_SCRIPT.read_text()))
    assert bare == {"LOCK_SHA256", "PDSERVE_SHA256"} and bare <= passed
    runs = of(CPU, "RUN")
    for arg in bare:
        assert any(f'test -n "${arg}"' in run for run in runs), f"{arg} must be used by the step it keys"
    assert f'cp "$HERE/{CPU.name}" "$CONTEXT/Containerfile"' in BUILD_SCRIPT.read_text()


def test_the_gpu_images_copy_sources_exist_in_its_context_serving() -> None:
    sources = copy_sources(GPU)
    assert sources, "the connector and the agent are copied in"
    assert [src for src in sources if not (SERVING / src).exists()] == []


def test_the_cpu_image_stands_on_the_pdserve_images_debian_base() -> None:
    base = [rest for rest in of(SERVING / "Containerfile", "ARG") if rest.startswith("BASE_IMAGE=")]
    assert base and base == [rest for rest in of(CPU, "ARG") if rest.startswith("BASE_IMAGE=")]
    sources = [rest for rest in of(SERVING / "Containerfile", "RUN") if "sources.list" in rest]
    assert sources and sources[0].split("&&")[0] in of(CPU, "RUN")[0]


def test_the_cpu_image_installs_the_lock_without_resolving_and_leaves_out_what_the_makefile_removes() -> None:
    install = " ".join(of(CPU, "RUN"))
    assert "--no-index --no-deps --find-links /tmp/wheels -r /tmp/vllm-lock.txt" in install
    removed = re.search(r"pip uninstall --quiet --yes ([a-z ]+)\n", (REPO / "Makefile").read_text())
    assert removed is not None and set(removed.group(1).split()) == LEFT_OUT


def test_the_gpu_base_image_is_an_argument_without_default() -> None:
    words = instructions(GPU)
    assert words[0] == ("ARG", "VLLM_IMAGE") and words[1] == ("FROM", "${VLLM_IMAGE}")
    assert all("=" not in rest for rest in of(GPU, "ARG")), "no ARG carries a default a build could fall back on"


def guard_accepts(reference: str) -> bool:
    guard = next(rest for rest in of(GPU, "RUN") if "VLLM_IMAGE" in rest)
    run = subprocess.run(
        ["sh", "-c", guard],
        env={"VLLM_IMAGE": reference, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0 or "is not pinned" in run.stderr
    return run.returncode == 0


@pytest.mark.parametrize(
    "reference",
    [
        f"docker.io/vllm/vllm-openai:v0.32.0@{DIGEST}",
        f"vllm/vllm-openai@{DIGEST}",
        "docker.io/vllm/vllm-openai:v0.32.0",
        "vllm/vllm-openai:latest",
        "vllm/vllm-openai@sha256:abc",
        f"vllm/vllm-openai@{DIGEST.upper()}",
        "",
    ],
)
def test_the_gpu_build_refuses_a_base_not_pinned_by_digest_as_the_stack_model_does(reference: str) -> None:
    assert guard_accepts(reference) is bool(IMAGE_BY_DIGEST.match(reference))


def test_the_gpu_image_pins_the_kv_channels_libraries_as_pdserve_does() -> None:
    pyproject = tomllib.loads((SERVING / "pyproject.toml").read_text())
    dependencies = "\n".join(pyproject["project"]["dependencies"])
    pins = dict(re.findall(r"^(google-crc32c|blake3)==([\w.]+)$", dependencies, re.M))
    installed = dict(re.findall(r"\b(google-crc32c|blake3)==([\w.]+)", " ".join(of(GPU, "RUN"))))
    assert set(pins) == {"google-crc32c", "blake3"} and installed == pins
    assert "--no-deps" in " ".join(of(GPU, "RUN")), "vLLM's own packages stay as the official image has them"


@pytest.mark.parametrize("path", [CPU, GPU], ids=["cpu", "gpu"])
def test_both_images_run_the_rendered_command_lines_as_a_non_root_user(path: object) -> None:
    assert [json.loads(rest) for rest in of(path, "ENTRYPOINT")] == [[VLLM_PYTHON, "-m", API_SERVER]]
    runs = " ".join(of(path, "RUN"))
    assert f"mkdir -p {RUN_DIR}" in runs or re.search(rf"mkdir -p \S+ {re.escape(RUN_DIR)}\b", runs)
    assert f"chown pdserve:pdserve {RUN_DIR}" in runs
    assert of(path, "USER")[-1] in ("pdserve", "10001")
