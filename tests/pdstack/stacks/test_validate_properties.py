"""Random mutations of valid stacks: a valid model or a clear problem report, never an exception."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdstack.stacks.files import StackFileError, load_stack_file
from pdstack.stacks.validate import validate
from tests.support import STACKS

EXAMPLES = {p.name: yaml.safe_load(p.read_text()) for p in sorted(STACKS.glob("Pulumi.*.yaml"))}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20),
    st.sampled_from(["prefill", "decode", "control", "local", "us-east-1", "10.0.0.0/8", "p5.48xlarge", "emulated"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def paths_in(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, child in node.items():
            found += paths_in(child, (*prefix, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            found += paths_in(child, (*prefix, i))
    return found


@st.composite
def mutated_stack(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(st.sampled_from(sorted(EXAMPLES)))
    doc = copy.deepcopy(EXAMPLES[name])
    for _ in range(draw(st.integers(1, 3))):
        targets = [p for p in paths_in(doc) if p]
        if not targets:
            break
        path = draw(st.sampled_from(targets))
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["replace", "delete", "rename", "duplicate"]))
        key = path[-1]
        if action == "replace":
            parent[key] = draw(values)
        elif action == "delete":
            del parent[key]
        elif action == "rename" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=12))] = parent.pop(key)
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        if not isinstance(doc, dict):
            break
    return name, doc


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_stack())
def test_mutated_stack_is_valid_or_reported(case: tuple[str, Any]) -> None:
    name, doc = case
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for other, content in EXAMPLES.items():
            (folder / other).write_text(yaml.safe_dump(content))
        (folder / name).write_text(yaml.safe_dump(doc, allow_unicode=True))
        report = validate([folder])  # must not raise
    for problem in report.problems:
        assert problem.reason.strip(), problem
        assert problem.file.startswith((tmp, "environment ")), problem


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_arbitrary_bytes_load_or_fail_cleanly(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "Pulumi.dev-x1.yaml"
        path.write_bytes(data)
        try:
            load_stack_file(path)
        except StackFileError as exc:
            assert exc.problems and all(p.file == str(path) and p.reason for p in exc.problems)
