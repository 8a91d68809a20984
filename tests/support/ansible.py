"""ansible-playbook as the tests run it, and what a run says: its exit code, its output and each host's recap;
ansible-lint's production profile."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO

ANSIBLE_PLAYBOOK = str(REPO / ".venv" / "bin" / "ansible-playbook")
ANSIBLE_LINT = str(REPO / ".venv" / "bin" / "ansible-lint")
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


def assert_lint_clean(targets: list[str], home: Path) -> None:
    """ansible-lint's production profile, offline, finds nothing in `targets` (paths under the repository)."""
    result = subprocess.run(
        [ANSIBLE_LINT, "--offline", "--profile", "production", "--nocolor", *targets],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={"PATH": f"{REPO / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(home)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
