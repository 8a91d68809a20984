"""The `pdstack` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from pdstack.bench.cli import bench_command
from pdstack.canary.command import canary_app
from pdstack.local.cli import local_app
from pdstack.plan.command import plan_command
from pdstack.validate import validate

app = typer.Typer(
    help="Prefill/decode-disaggregated LLM inference across datacenters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def project_stacks_dir(start: Path | None = None) -> Path:
    """The `stacks/` folder of the Pulumi project holding `start` (default: the working directory)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "Pulumi.yaml").is_file():
            return folder / "stacks"
    return here / "stacks"


app.command("plan")(plan_command)
app.command("bench")(bench_command)
app.add_typer(canary_app, name="canary")
app.add_typer(local_app, name="local")


@app.callback()
def main() -> None:
    """pdstack: validate, plan and synthesise stacks; run the local environment."""


@app.command("validate")
def validate_command(
    paths: Annotated[
        list[Path] | None, typer.Argument(help="stack files or folders (default: the project's stacks/)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable report")] = False,
) -> None:
    """Check every stack file, then every environment as a whole. Exit 1 on any problem, one line each."""
    targets = paths or [project_stacks_dir()]
    missing = [p for p in targets if not p.exists()]
    if missing:
        typer.echo(f"no such file or folder: {', '.join(map(str, missing))}", err=True)
        raise typer.Exit(2)
    report = validate(targets)
    if as_json:
        typer.echo(json.dumps(report.as_json(), indent=2))
    elif report.valid:
        envs = report.environments()
        summary = ", ".join(f"{env} ({len(stacks)})" for env, stacks in sorted(envs.items()))
        typer.echo(f"ok: {len(report.stacks)} stacks valid: {summary}")
    else:
        for problem in sorted(report.problems):
            typer.echo(str(problem))
    raise typer.Exit(0 if report.valid else 1)


@app.command("synth")
def synth_command(
    stacks: Annotated[
        list[str] | None, typer.Option("--stack", help="stack name, e.g. prod-control; repeatable (default: all)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable resource graph and verdicts")] = False,
) -> None:
    """Run the Pulumi program under mocks, offline: list the resources a stack would create and the policy
    verdicts on them. Exit 1 on a violation."""
    from pdstack.synth import SynthError, run_command  # noqa: PLC0415 (pulumi is heavy: load it only here)

    try:
        text, status = run_command(project_stacks_dir(), stacks or [], as_json)
    except SynthError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    typer.echo(text)
    raise typer.Exit(status)
