"""ansible-playbook as the tests run it, and what a run says: its exit code, its output and each host's recap; a
playbook run on this host (run_local_playbook); the ansible-lint command the repository documents."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO

ANSIBLE_PLAYBOOK = str(REPO / ".venv" / "bin" / "ansible-playbook")
ANSIBLE_LINT = str(REPO / ".venv" / "bin" / "ansible-lint")
LINT_CONFIG = REPO / ".ansible-lint"
# A host's line of the PLAY RECAP; `pdstack local` prefixes the playbooks' output it relays with "== ".
RECAP = re.compile(
    r"^(?:== )?(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
    r"\s+failed=(?P<failed>\d+)",
    re.MULTILINE,
)


@dataclass
class PlaybookRun:
    """One ansible-playbook run: its exit code and output (stdout, then stderr)."""

    returncode: int
    output: str

    def recap(self, host: str) -> dict[str, int]:
        """ok, changed, unreachable and failed of `host`'s recap line."""
        for match in RECAP.finditer(self.output):
            if match["host"] == host:
                return {k: int(v) for k, v in match.groupdict().items() if k != "host"}
        raise AssertionError(f"no recap for {host} in:\n{self.output[-3000:]}")

    def changed(self) -> int:
        """Tasks changed, summed over every host's recap."""
        return sum(int(match["changed"]) for match in RECAP.finditer(self.output))


def run_local_playbook(
    playbook: Path,
    home: Path,
    *extra_vars: str,
    inventory: str = "localhost,",
    env: Mapping[str, str] | None = None,
) -> PlaybookRun:
    """`playbook` on this host with the repository's ansible.cfg, each of `extra_vars` as an -e (`@file` or JSON)
    and the system's Python as the interpreter; HOME is `home`, so nothing of the developer's is read, and `env` is
    added to the little else the run sees."""
    extras = [word for value in extra_vars for word in ("-e", value)]
    result = subprocess.run(
        [
            ANSIBLE_PLAYBOOK,
            "-i",
            inventory,
            str(playbook),
            *extras,
            "-e",
            "ansible_python_interpreter=/usr/bin/python3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={
            "PATH": "/usr/bin:/bin",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "HOME": str(home),
            **(env or {}),
        },
    )
    return PlaybookRun(result.returncode, result.stdout + result.stderr)


def documented_lint_command() -> list[str]:
    """The command .ansible-lint says to run (its comment: `run: ansible-lint ...`), with .venv's ansible-lint."""
    match = re.search(r"\(run: ansible-lint ([^)]*)\)", LINT_CONFIG.read_text())
    assert match, f"{LINT_CONFIG} names no `run: ansible-lint ...` command"
    return [ANSIBLE_LINT, *match[1].split()]


def assert_lint_clean(home: Path) -> None:
    """The documented ansible-lint command, run where .ansible-lint configures it (production profile, offline),
    finds nothing: no failure and no warning."""
    result = subprocess.run(
        [*documented_lint_command(), "--nocolor"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={"PATH": f"{REPO / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(home)},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "0 failure(s), 0 warning(s)" in output, output
