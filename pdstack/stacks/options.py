"""The options every subcommand that reads stacks shares: `--stacks DIR`, `--env NAME`, `--json`.

- `--stacks DIR`: the folder of stack files; by default the `stacks/` of the project holding the working directory
  (found by walking up to `Pulumi.yaml`), so every subcommand finds the same stacks from any folder of the project.
- `--env NAME`: the environment whose stacks the command reads (`pdstack.stacks.environment.load_environment`).
- `--json`: stdout carries exactly one JSON document and nothing else; messages go to stderr; the exit codes are
  those of the text output. A usage error (exit 2) prints nothing on stdout.

Old spellings (`plan --stacks-dir`, `canary --stack-dir`, `local --project`, `validate PATH...`) still work, print a
deprecation warning on stderr, and will be removed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdstack.stacks.environment import EnvironmentLoadError, EnvironmentStacks, default_stacks_dir, load_environment

STACKS_HELP = "folder of stack files (default: the stacks/ of the project holding the working directory)"
StacksOption = Annotated[Path | None, typer.Option("--stacks", metavar="DIR", help=STACKS_HELP)]
JsonOption = Annotated[bool, typer.Option("--json", help="stdout: exactly one JSON document; messages on stderr")]
EnvOption = Annotated[str | None, typer.Option("--env", metavar="NAME", help="environment whose stacks to read")]


def stacks_dir(given: Path | None, old: Path | None = None, old_name: str = "") -> Path:
    """The folder `--stacks` names (or an old spelling `old_name`, with a warning); the project's stacks/ by default."""
    if old is not None:
        typer.echo(f"warning: {old_name} is deprecated and will be removed; use --stacks", err=True)
        if given is not None and given.resolve() != old.resolve():
            raise typer.BadParameter(f"--stacks {given} and {old_name} {old} disagree", param_hint="--stacks")
        given = given or old
    folder = given if given is not None else default_stacks_dir()
    if not folder.is_dir():
        raise typer.BadParameter(f"no such folder: {folder}", param_hint="--stacks")
    return folder


def environment(folder: Path, env: str) -> EnvironmentStacks:
    """`load_environment`, with its problems as a usage error (exit 2, one line each, on stderr)."""
    try:
        return load_environment(folder, env)
    except EnvironmentLoadError as exc:
        raise typer.BadParameter(str(exc), param_hint="--env") from None
