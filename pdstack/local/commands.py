"""Running a command to its end with its output captured: the one way pdstack.local runs `ip`, `podman`, `git` and
the like. A failure raises CommandError, which names the command, its exit status and the tail of what it printed."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

OUTPUT_TAIL = 2000  # characters of a failed command's output that its error carries


class CommandError(RuntimeError):
    """A command exited non-zero."""

    def __init__(self, argv: Sequence[str], returncode: int, output: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        tail = output.strip()[-OUTPUT_TAIL:] or "(no output)"
        super().__init__(f"`{' '.join(self.argv)}` failed with exit {returncode}: {tail}")


def run_captured(
    argv: Sequence[str], *, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run `argv` (no shell) with `stdin` as its input; its output is text (undecodable bytes replaced). With `check`,
    a non-zero exit raises CommandError carrying standard output then standard error."""
    result = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, errors="replace", check=False)
    if check and result.returncode != 0:
        raise CommandError(argv, result.returncode, result.stdout + result.stderr)
    return result
