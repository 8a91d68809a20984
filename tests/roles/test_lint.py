"""The roles and playbooks pass ansible-lint's production profile."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support import REPO

ANSIBLE_LINT = str(REPO / ".venv" / "bin" / "ansible-lint")


def test_ansible_lint_production_profile(tmp_path: Path) -> None:
    roles = ["gpu_driver", "numa", "time_sync", "storage", "kernel_tuning", "container_runtime", "node_exporter"]
    targets = [f"roles/{role}" for role in roles] + ["playbooks/baseline.yml"]
    result = subprocess.run(
        [ANSIBLE_LINT, "--offline", "--profile", "production", "--nocolor", *targets],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={"PATH": f"{REPO / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
