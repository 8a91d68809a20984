"""`pdstack local ...`: the local two-datacenter environment."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pdstack.local.commands import CommandError
from pdstack.local.engine_choice import EngineError
from pdstack.local.inventory import render_inventory
from pdstack.local.network import NetworkError
from pdstack.local.nodes import NodeError
from pdstack.local.registry import RegistryError
from pdstack.local.topology import TopologyError
from pdstack.stacks.environment import PROJECT_FILE, STACKS_FOLDER
from pdstack.stacks.options import JsonOption, StacksOption, stacks_dir

if TYPE_CHECKING:
    from pdstack.local.env import LocalEnv


local_app = typer.Typer(
    help="Run all of pdstack on this machine: two emulated datacenters and a control plane.", no_args_is_help=True
)

# `pdstack local` reads the `local` environment of --stacks (the project's stacks/ by default); it also needs the
# project around them (playbooks, roles, inventories/local, .cache/local), so --stacks must be a project's stacks/.
ProjectOption = Annotated[
    Path | None, typer.Option("--project", hidden=True, help="deprecated: use --stacks PROJECT/stacks")
]


def _env(stacks: Path | None, project: Path | None) -> LocalEnv:
    # pdstack.local.env loads the openai client (~1 s): only the `local` commands pay for it, not every `pdstack` run.
    from pdstack.local.env import LocalEnv  # noqa: PLC0415

    folder = stacks_dir(stacks, project / STACKS_FOLDER if project is not None else None, "--project")
    root = folder.resolve().parent
    if folder.resolve().name != STACKS_FOLDER or not (root / PROJECT_FILE).is_file():
        typer.echo(f"{folder} is not the stacks/ folder of a pdstack project (beside a {PROJECT_FILE})", err=True)
        raise typer.Exit(2)
    return LocalEnv(root)


EngineOption = Annotated[
    str | None,
    typer.Option(
        "--engine",
        envvar="PDSTACK_LOCAL_ENGINE",
        help="pdserve | vllm on the prefill and decode nodes (default: the stack's serving.engine)",
    ),
]
ConvergeOption = Annotated[
    bool,
    typer.Option(
        "--converge",
        help="run the playbooks even when nothing they read changed and every node runs the "
        "containers they left (a warm up skips them then)",
    ),
]


def _progress(line: str) -> None:
    typer.echo(f"== {line}", err=True)


@local_app.command("up")
def up_command(
    stacks: StacksOption = None,
    project: ProjectOption = None,
    engine: EngineOption = None,
    converge: ConvergeOption = False,
) -> None:
    """Bring the local environment up (idempotent) and print where it answers."""
    from pdstack.local.env import PlaybookError  # noqa: PLC0415 (see _env)

    # What `up` reports as a message and exit 1: each names the step and carries the cause; anything else is a bug.
    up_errors = (TopologyError, EngineError, CommandError, NetworkError, RegistryError, NodeError, PlaybookError)
    try:
        status = _env(stacks, project).up(say=_progress, engine=engine, converge=converge)
    except up_errors as error:
        typer.echo(f"pdstack local up: {error}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"engine:     {status['engine']} (model {status['model']})")
    typer.echo(f"completion: {status['smoke']!r}")
    typer.echo(f"gateway:    {status['gateway_url']}")
    typer.echo(f"CA:         {status['ca_file']} (verify the gateway with it: docs/local.md)")
    typer.echo(f"client:     {status['client_cert']} and its key (the scheduler's and servers' APIs ask for it)")
    typer.echo(f"API key:    in {status['api_key_file']}")
    typer.echo(f"Prometheus: {status['prometheus_url']}")


@local_app.command("down")
def down_command(stacks: StacksOption = None, project: ProjectOption = None) -> None:
    """Remove every container, namespace, link and rule the local environment made."""
    env = _env(stacks, project)
    env.down(say=_progress)
    leftovers = env.status()["leftovers"]
    if leftovers:
        typer.echo(f"left behind: {', '.join(leftovers)}", err=True)
        raise typer.Exit(1)


@local_app.command("status")
def status_command(stacks: StacksOption = None, project: ProjectOption = None, as_json: JsonOption = False) -> None:
    """Gateway URL, API key file, Prometheus URL and nodes by datacenter."""
    status = _env(stacks, project).status()
    if as_json:
        typer.echo(json.dumps(status, indent=2))
        return
    typer.echo(
        f"gateway: {status['gateway_url']}  CA: {status['ca_file']}  API key file: {status['api_key_file']}  "
        f"Prometheus: {status['prometheus_url']}"
    )
    for dc, members in status["nodes"].items():
        listed = ", ".join(f"{n['name']} ({n['address']}, {'up' if n['running'] else 'down'})" for n in members)
        typer.echo(f"{dc}: {listed}")


@local_app.command("scale")
def scale_command(
    datacenter: Annotated[str, typer.Argument(metavar="DATACENTER", help="a local datacenter, e.g. dc2")],
    pool: Annotated[str, typer.Argument(metavar="POOL", help="one of its GPU pools, e.g. decode")],
    desired: Annotated[int, typer.Argument(metavar="N", help="the pool's node count, within its min and max")],
    *,
    stacks: StacksOption = None,
    project: ProjectOption = None,
    as_json: JsonOption = False,
) -> None:
    """Set a pool's desired capacity, as its Auto Scaling group does: a node added boots from the pool's user data
    and joins by itself; a node removed is drained first (docs/local.md)."""
    from pdstack.local.aws import LocalAwsError  # noqa: PLC0415 (see _env)
    from pdstack.local.groups import ScaleError, scale  # noqa: PLC0415
    from pdstack.local.pools import CapacityError  # noqa: PLC0415

    errors = (CapacityError, ScaleError, LocalAwsError, CommandError, NetworkError, NodeError)
    try:
        report = scale(_env(stacks, project), datacenter, pool, desired, say=_progress)
    except errors as error:
        typer.echo(f"pdstack local scale: {error}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(report), indent=2))
        return
    typer.echo(f"{datacenter}/{pool}: {desired} nodes (release {report.release or 'unchanged'})")
    for node in report.launched:
        phases = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in node.seconds.items())
        apply = ", ".join(f"{part} {seconds:.1f}s" for part, seconds in node.apply.items())
        typer.echo(f"  launched {node.node} ({node.instance_id}): {phases}")
        typer.echo(f"    apply: {apply}; model: {node.model_bytes} bytes from the bucket")
    for name in report.removed:
        typer.echo(f"  drained and removed {name}")


@local_app.command("inventory")
def inventory_command(stacks: StacksOption = None, project: ProjectOption = None) -> None:
    """Print the Ansible inventory the local stacks render to (committed as inventories/local/hosts.yml)."""
    typer.echo(render_inventory(_env(stacks, project).topology()), nl=False)


@local_app.command("link")
def link_command(
    a: Annotated[str, typer.Argument(metavar="A", help="a datacenter at one end of the link")],
    b: Annotated[str, typer.Argument(metavar="B", help="the datacenter at the other end")],
    *,
    loss_pct: Annotated[float | None, typer.Option("--loss-pct", help="random loss, percent, in [0, 100)")] = None,
    rtt_ms: Annotated[float | None, typer.Option("--rtt-ms", help="round-trip delay, ms")] = None,
    rate_mbit: Annotated[float | None, typer.Option("--rate-mbit", help="rate, Mbit/s")] = None,
    reset: Annotated[bool, typer.Option("--reset", help="back to the values the stacks declare")] = False,
    stacks: StacksOption = None,
    project: ProjectOption = None,
    as_json: JsonOption = False,
) -> None:
    """Change a running WAN link's loss, delay or rate (like `tc qdisc change ... netem`) and print its spec.

    Connections across the link live on: the forwarder applies the change to the packets that arrive from then on.
    Without options, only prints the spec in force.
    """
    env = _env(stacks, project)
    try:
        status = env.network(env.topology()).shape_link(
            a, b, loss_pct=loss_pct, rtt_ms=rtt_ms, rate_mbit=rate_mbit, reset=reset
        )
    except (NetworkError, ValueError) as error:
        typer.echo(f"pdstack local link: {error}", err=True)
        raise typer.Exit(1) from error
    if as_json:
        typer.echo(json.dumps(status.as_dict(), indent=2))
        return
    typer.echo(f"{a}<->{b}: {status.spec.describe()}")
    if status.spec != status.declared:
        typer.echo(f"  declared: {status.declared.describe()} (--reset goes back)")
