"""`pdstack dashboards`: write monitoring/dashboards/*.json from the generator, or check they are current."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdstack.dashboards import DEFAULT_DIR

DirOption = Annotated[Path, typer.Option("--dir", help="where the dashboard JSON files live")]


def dashboards_command(
    directory: DirOption = DEFAULT_DIR,
    check: Annotated[bool, typer.Option("--check", help="only report files that differ from the generator")] = False,
) -> None:
    """Generate the Grafana dashboards (fleet, prefill-decode, kv, node) as JSON files."""
    # Imported here: the rest of the CLI must not need grafana-foundation-sdk.
    from pdstack.dashboards.files import stale, write  # noqa: PLC0415

    if check:
        outdated = stale(directory)
        if outdated:
            typer.echo(f"stale dashboards in {directory}: {', '.join(outdated)}; run `pdstack dashboards`", err=True)
            raise typer.Exit(1)
        typer.echo(f"dashboards in {directory} are current")
        return
    for path in write(directory):
        typer.echo(f"wrote {path}")
