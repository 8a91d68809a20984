"""The `pdstack` command line."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Annotated

import typer

from pdstack.bench.cli import bench_command
from pdstack.canary.command import canary_app
from pdstack.dashboards.command import dashboards_command
from pdstack.local.cli import local_app
from pdstack.node.cli import node_app
from pdstack.plan.command import plan_command
from pdstack.stacks.environment import default_stacks_dir
from pdstack.stacks.files import stack_name_of
from pdstack.stacks.options import EnvOption, JsonOption, StacksOption, stacks_dir
from pdstack.stacks.validate import stack_paths, validate

app = typer.Typer(
    help="Prefill/decode-disaggregated LLM inference across datacenters.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def project_stacks_dir(start: Path | None = None) -> Path:
    """The `stacks/` folder of the Pulumi project holding `start` (default: the working directory)."""
    return default_stacks_dir(start)


app.command("plan")(plan_command)
app.command("bench")(bench_command)
app.command("dashboards")(dashboards_command)
app.add_typer(canary_app, name="canary")
app.add_typer(local_app, name="local")
app.add_typer(node_app, name="node")


def print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"pdstack {importlib.metadata.version('pdstack')}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=print_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """pdstack: validate, plan and synthesise stacks; run the local environment."""


@app.command("validate")
def validate_command(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(help="deprecated: stack files or folders to check instead of --stacks", show_default=False),
    ] = None,
    *,
    stacks: StacksOption = None,
    env: EnvOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check every stack file, then every environment as a whole. Exit 1 on any problem, one line each."""
    if paths:
        typer.echo("warning: validate PATH... is deprecated and will be removed; use --stacks DIR", err=True)
        missing = [p for p in paths if not p.exists()]
        if missing:
            typer.echo(f"no such file or folder: {', '.join(map(str, missing))}", err=True)
            raise typer.Exit(2)
        targets = stack_paths(paths)
    else:
        targets = stack_paths([stacks_dir(stacks)])
    if env is not None:
        targets = [p for p in targets if (stack_name_of(p) or "").split("-", 1)[0] == env]
        if not targets:
            raise typer.BadParameter(f"no stack files of environment {env!r}", param_hint="--env")
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
    names: Annotated[
        list[str] | None,
        typer.Option("--stack", metavar="NAME", help="one stack, e.g. prod-control; repeatable (default: all)"),
    ] = None,
    *,
    stacks: StacksOption = None,
    env: EnvOption = None,
    as_json: JsonOption = False,
) -> None:
    """Run the Pulumi program under mocks, offline: list the resources a stack would create and the policy
    verdicts on them. Exit 1 on a violation."""
    from pdstack.synth.report import run_command  # noqa: PLC0415
    from pdstack.synth.synthesis import SynthError  # noqa: PLC0415 (pulumi is heavy: load it only here)

    try:
        text, status = run_command(stacks_dir(stacks), names or [], as_json, env=env)
    except SynthError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    typer.echo(text)
    raise typer.Exit(status)
