"""What /proc says about a process: whether it runs, and its command line."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def command_line(pid: int) -> list[str]:
    """The arguments process `pid` runs with; empty when it does not exist or has exited (a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []
