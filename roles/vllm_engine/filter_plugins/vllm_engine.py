"""Filters of the vllm_engine role: the rendered command lines' placeholders filled in, and the podman secret
mounts each container gets (pdserve's secrets.yml makes them as `NAME-DIGEST,type=mount,target=FILE,...`)."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError


def vllm_engine_fill(value: Any, fills: list[list[str]]) -> Any:
    """`value` (a string, a list of them or a dict of them) with each placeholder replaced by its node value."""
    if isinstance(value, dict):
        return {key: vllm_engine_fill(item, fills) for key, item in value.items()}
    if isinstance(value, list):
        return [vllm_engine_fill(item, fills) for item in value]
    text = str(value)
    for placeholder, actual in fills:
        if not placeholder:
            raise AnsibleFilterError("vllm_engine_fill: empty placeholder (vllm_engine_stack['placeholders'])")
        text = text.replace(placeholder, str(actual))
    return text


def _mount_of(mounts: list[str], target: str) -> str:
    found = [m for m in mounts if f",target={target}," in f"{m},"]
    if len(found) != 1:
        raise AnsibleFilterError(f"vllm_engine: no podman secret mounted as {target!r} (pdserve secrets.yml)")
    return found[0]


def vllm_engine_mounts(mounts: list[str], secrets: list[str], targets: dict[str, str]) -> list[str]:
    """The secret mounts of the stack secrets `secrets`, found by their file name in the contract (`targets`)."""
    missing = [s for s in secrets if s not in targets]
    if missing:
        raise AnsibleFilterError(f"vllm_engine: the contract mounts no file for {', '.join(missing)}")
    return [_mount_of(mounts, targets[s]) for s in secrets]


class FilterModule:
    def filters(self) -> dict[str, object]:
        return {
            "vllm_engine_fill": vllm_engine_fill,
            "vllm_engine_mounts": vllm_engine_mounts,
        }
