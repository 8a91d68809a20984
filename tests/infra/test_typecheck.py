"""The type check of the Pulumi program catches a misspelled resource argument (what `make typecheck` relies on)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

BASEDPYRIGHT = Path(sys.executable).with_name("basedpyright")


def run_check(project: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BASEDPYRIGHT), "--project", str(project), "--pythonpath", sys.executable],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_misspelled_argument_of_a_copied_component_fails_the_check(tmp_path: Path) -> None:
    shutil.copytree(REPO / "infra", tmp_path / "infra")
    shutil.copy(REPO / "pyproject.toml", tmp_path)  # the project's own [tool.basedpyright] settings
    (tmp_path / "pdstack").symlink_to(REPO / "pdstack")  # the program imports the stack model
    component = tmp_path / "infra" / "network.py"
    source = component.read_text()
    assert source.count("enable_dns_hostnames=") == 1
    component.write_text(source.replace("enable_dns_hostnames=", "enable_dns_hostname="))
    line = next(n for n, text in enumerate(component.read_text().splitlines(), 1) if "enable_dns_hostname=" in text)
    vpc_call = next(n for n in range(line, 0, -1) if "aws.ec2.Vpc(" in source.splitlines()[n - 1])

    result = run_check(tmp_path)

    assert result.returncode != 0, result.stdout
    errors = re.findall(r"(\S+\.py):(\d+):\d+ - error: (.*)", result.stdout)
    assert {(Path(file).name, int(number)) for file, number, _ in errors} == {("network.py", vpc_call)}, result.stdout
    assert "No overloads" in result.stdout and "reportCallIssue" in result.stdout
