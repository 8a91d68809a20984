"""The example stacks' resource graphs, built once per session by running infra/ under Pulumi mocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdstack.stackfile import load_stack_file
from pdstack.synth import Synthesis, synthesize

ROOT = Path(__file__).resolve().parents[2]
STACKS = ROOT / "stacks"
CLOUD_STACKS = sorted(
    p.name[len("Pulumi.") : -len(".yaml")]
    for p in STACKS.glob("Pulumi.*.yaml")
    if load_stack_file(p).config.environment != "local"
)


@pytest.fixture(scope="session")
def graphs() -> dict[str, Synthesis]:
    return {name: synthesize(STACKS / f"Pulumi.{name}.yaml") for name in CLOUD_STACKS}


def stack_config(name: str):
    return load_stack_file(STACKS / f"Pulumi.{name}.yaml").config
