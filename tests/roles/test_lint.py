"""The roles and playbooks pass ansible-lint's production profile."""

from __future__ import annotations

from pathlib import Path

from tests.support.ansible import assert_lint_clean


def test_ansible_lint_production_profile(tmp_path: Path) -> None:
    roles = ["gpu_driver", "numa", "time_sync", "storage", "kernel_tuning", "container_runtime", "node_exporter"]
    targets = [f"roles/{role}" for role in roles] + ["playbooks/baseline.yml"]
    assert_lint_clean(targets, tmp_path)
