"""pdstack.local.converged: when a warm `pdstack local up` may skip its playbooks."""

from __future__ import annotations

from pathlib import Path

from pdstack.local.converged import ConvergeRecord, inputs_digest

LEFT = {"control-1": ["pdserve-gateway 1a2b", "pdserve-scheduler 3c4d"], "dc2-decode-1": ["pdserve-decode 5e6f"]}


def tree(root: Path) -> list[Path]:
    (root / "roles" / "pdserve" / "tasks").mkdir(parents=True)
    (root / "roles" / "pdserve" / "tasks" / "main.yml").write_text("- name: a task\n")
    (root / "release.json").write_text('{"version": "r1"}\n')
    return [root / "release.json", root / "roles", root / "absent.yml"]


def test_the_digest_follows_every_input_file_and_nothing_else(tmp_path: Path) -> None:
    inputs = tree(tmp_path)
    first = inputs_digest(tmp_path, inputs)
    assert inputs_digest(tmp_path, inputs) == first
    cache = tmp_path / "roles" / "pdserve" / "filter_plugins" / "__pycache__"
    cache.mkdir(parents=True)
    (cache / "tokens.cpython-311.pyc").write_bytes(b"\0")  # what loading a filter plugin leaves behind
    assert inputs_digest(tmp_path, inputs) == first
    (tmp_path / "roles" / "pdserve" / "tasks" / "main.yml").write_text("- name: a changed task\n")
    changed_role = inputs_digest(tmp_path, inputs)
    assert changed_role != first
    (tmp_path / "roles" / "pdserve" / "tasks" / "extra.yml").write_text("")
    assert inputs_digest(tmp_path, inputs) != changed_role  # a new file counts, even an empty one
    (tmp_path / "absent.yml").write_text("now here\n")
    assert inputs_digest(tmp_path, inputs) != changed_role


def test_a_warm_up_skips_only_with_the_same_inputs_and_the_same_containers(tmp_path: Path) -> None:
    record = ConvergeRecord(tmp_path / "converged.json")
    assert not record.unchanged("d1", LEFT)  # never converged
    record.save("d1", LEFT)
    assert record.unchanged("d1", {k: list(v) for k, v in LEFT.items()})
    assert not record.unchanged("d2", LEFT)  # an input changed
    replaced = {**LEFT, "dc2-decode-1": ["pdserve-decode 9999"]}  # a canary deploy or a rollback replaced it
    assert not record.unchanged("d1", replaced)
    assert not record.unchanged("d1", {**LEFT, "dc2-decode-1": []})  # a container gone, or a node made afresh
    assert not record.unchanged("d1", {**LEFT, "dc1-prefill-1": []})  # a node the last converge did not know
    record.forget()
    assert not record.unchanged("d1", LEFT)
