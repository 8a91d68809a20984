"""`pdstack node` (also `python -m pdstack.node`, which stage 0 runs from the bundle's venv): the node's bootstrap
and the user data a pool boots from (for people and the local environment); for operators, the node bundle and
publishing a release (docs/node-bootstrap.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from pdstack.node.loader import NODE_CONFIG, BootstrapError, Phase, report_failure
from pdstack.stacks.options import StacksOption, environment, stacks_dir

node_app = typer.Typer(
    help="A GPU node that joins by itself: its bootstrap, its user data, its bundle and the release it reads.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@node_app.command("bootstrap")
def bootstrap_command(
    config: Annotated[Path, typer.Option("--config", help="the node's node.json")] = NODE_CONFIG,
    bundle_seconds: Annotated[
        float, typer.Option("--bundle-seconds", help="time stage 0 spent on the bundle (its phase's metric)")
    ] = 0.0,
) -> None:
    """Bring this node to the environment's current release; exit 1 after reporting a failure."""
    from pydantic import ValidationError  # noqa: PLC0415

    from pdstack.node.bootstrap import NodePaths, bootstrap  # noqa: PLC0415
    from pdstack.node.config import load_node_config  # noqa: PLC0415

    try:
        node = load_node_config(config)
    except (OSError, ValidationError) as exc:
        error = BootstrapError(Phase.IDENTITY, f"cannot read {config}: {exc}")
        report_failure(error, {}, autoscaling=None, instance=None, textfile_dir=NodePaths().textfile_dir)
        raise typer.Exit(1) from None
    try:
        result = bootstrap(node, bundle_seconds=bundle_seconds)
    except BootstrapError:
        raise typer.Exit(1) from None  # reported: the metric, Unhealthy, the message on stderr
    phases = ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in result.seconds.items())
    typer.echo(
        f"pdstack-node: {result.instance_id} ready for release {result.release}: model {result.model.files} files, "
        f"{result.model.downloaded_bytes} bytes downloaded; {phases}"
    )


@node_app.command("drain")
def drain_command(
    config: Annotated[Path, typer.Option("--config", help="the node's node.json")] = NODE_CONFIG,
    complete_lifecycle: Annotated[
        bool,
        typer.Option(
            "--complete-lifecycle", help="then let the pool's group terminate this instance (the cloud's hook)"
        ),
    ] = False,
) -> None:
    """Drain this node's server (no new requests, in-flight ones finish, deregistered, stopped); exit 1 if it cannot."""
    from pdstack.node.drain import DrainError, drain_node  # noqa: PLC0415

    try:
        drain_node()
    except DrainError as exc:
        typer.echo(f"pdstack-node: drain: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo("pdstack-node: drained")
    if complete_lifecycle:
        _complete_lifecycle(config)


@node_app.command("watch-termination")
def watch_termination_command(
    config: Annotated[Path, typer.Option("--config", help="the node's node.json")] = NODE_CONFIG,
) -> None:
    """Wait until the pool's group chooses this instance for scale-in (its metadata's target lifecycle state), then
    drain and complete the lifecycle action; a failed drain still completes it (the group must not wait for a dead
    server) and exits 1."""
    from pdstack.node.drain import DrainError, drain_node, wait_for_termination  # noqa: PLC0415

    wait_for_termination()
    try:
        drain_node()
    except DrainError as exc:
        typer.echo(f"pdstack-node: drain: {exc}", err=True)
        _complete_lifecycle(config)
        raise typer.Exit(1) from None
    _complete_lifecycle(config)


def _complete_lifecycle(config_path: Path) -> None:
    from pdstack.node.config import load_node_config  # noqa: PLC0415
    from pdstack.node.drain import complete_termination  # noqa: PLC0415
    from pdstack.node.loader import aws_client, instance_id  # noqa: PLC0415

    config = load_node_config(config_path)
    autoscaling = aws_client("autoscaling", config.aws_region, config.aws_endpoint_url)
    complete_termination(autoscaling, config, instance_id())
    typer.echo("pdstack-node: lifecycle action completed: the group terminates this instance")


@node_app.command("user-data")
def user_data_command(
    stack: Annotated[
        str, typer.Option("--stack", metavar="NAME", help="a datacenter stack, e.g. prod-decode-us-west-2")
    ],
    pool: Annotated[str, typer.Option("--pool", metavar="NAME", help="one of its GPU pools")],
    stacks: StacksOption = None,
    aws_endpoint_url: Annotated[
        str | None, typer.Option("--aws-endpoint-url", help="the local environment's AWS APIs (moto)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print node.json instead of the whole user data")] = False,
) -> None:
    """Print the `#cloud-config` a pool's instances boot from."""
    from pdstack.node.userdata import UserDataError, node_config, render_user_data  # noqa: PLC0415

    env = environment(stacks_dir(stacks), stack.split("-", 1)[0])
    config = env.stack(stack).config
    try:
        if as_json:
            typer.echo(
                json.dumps(node_config(config, env.control.config, pool, aws_endpoint_url).model_dump(), indent=2)
            )
        else:
            typer.echo(render_user_data(config, env.control.config, pool, aws_endpoint_url), nl=False)
    except UserDataError as exc:
        raise typer.BadParameter(str(exc), param_hint="--pool") from None


@node_app.command("bundle")
def bundle_command(
    env: Annotated[str, typer.Option("--env", metavar="ENV", help="the environment, e.g. prod")],
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="where pdstack-node-<env>.tar.gz is written")],
    wheels: Annotated[
        bool, typer.Option("--wheels/--no-wheels", help="--no-wheels: leave wheels/ out (no node can install it)")
    ] = True,
    repo: Annotated[
        Path | None, typer.Option("--repo", metavar="DIR", help="the pdstack checkout (default: this one)")
    ] = None,
) -> None:
    """Build the node bundle of an environment (roles, playbooks, collections, wheels) and print its sha256."""
    from pdstack.node.bundle import BundleError, build_bundle  # noqa: PLC0415
    from pdstack.stacks.environment import find_project  # noqa: PLC0415

    project = repo or find_project()
    if project is None:
        raise typer.BadParameter("not inside a pdstack checkout", param_hint="--repo")
    started = time.monotonic()
    try:
        built = build_bundle(project, env, out, wheels=wheels)
    except BundleError as exc:
        typer.echo(f"pdstack node bundle: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"{built.path}: {len(built.members)} files, {built.size / 1e6:.1f} MB in {time.monotonic() - started:.1f} s",
        err=True,
    )
    typer.echo(f"{built.sha256}  {built.path}")


def _pairs(values: list[str], option: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, item = value.partition("=")
        if not sep or not key or not item:
            raise typer.BadParameter(f"{value!r} is not NAME=VALUE", param_hint=option)
        pairs[key] = item
    return pairs


@node_app.command("publish")
def publish_command(
    *,
    env: Annotated[str, typer.Option("--env", metavar="ENV", help="the environment, e.g. prod")],
    release: Annotated[str, typer.Option("--release", metavar="NAME", help="the release's name, e.g. 2026-12-07.1")],
    bundle: Annotated[Path, typer.Option("--bundle", metavar="FILE", help="the node bundle (pdstack node bundle)")],
    model_dir: Annotated[Path, typer.Option("--model-dir", metavar="DIR", help="the model's files")],
    model_revision: Annotated[
        str, typer.Option("--model-revision", metavar="REV", help="e.g. the Hugging Face commit they came from")
    ],
    image: Annotated[
        list[str],
        typer.Option("--image", metavar="COMPONENT=REF", help="an image by digest, e.g. decode=...@sha256:.."),
    ],
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="default: the stack's serving.model.name")
    ] = None,
    account: Annotated[
        str | None, typer.Option("--account", help="the AWS account of the buckets (default: the caller's)")
    ] = None,
    bucket: Annotated[
        list[str] | None,
        typer.Option("--bucket", metavar="DC=BUCKET", help="a datacenter's bucket, if not the default"),
    ] = None,
    aws_endpoint_url: Annotated[
        str | None, typer.Option("--aws-endpoint-url", help="the local environment's AWS APIs (moto)")
    ] = None,
    stacks: StacksOption = None,
) -> None:
    """Upload the bundle and the model to each GPU datacenter's bucket, then write the release record to SSM."""
    from pdstack.node.loader import aws_client  # noqa: PLC0415
    from pdstack.node.publish import gpu_datacenters, model_bucket, publish  # noqa: PLC0415

    stacks_env = environment(stacks_dir(stacks), env)
    control = stacks_env.control.config
    if control.serving is None:
        raise typer.BadParameter(f"environment {env} serves nothing", param_hint="--env")

    def clients(service: str, region: str) -> object:
        return aws_client(service, region, aws_endpoint_url)

    buckets = _pairs(bucket or [], "--bucket")
    missing = [dc for dc in gpu_datacenters(stacks_env) if dc not in buckets]
    if missing:
        from pdstack.node.userdata import api_region  # noqa: PLC0415

        owner = account or str(
            clients("sts", api_region(control.datacenter.region)).get_caller_identity()["Account"]  # type: ignore[attr-defined]
        )
        buckets |= {dc: model_bucket(env, dc, owner) for dc in missing}
    try:
        published = publish(
            stacks_env,
            release=release,
            bundle=bundle,
            model_dir=model_dir,
            model_name=model_name or control.serving.model.name,
            model_revision=model_revision,
            images=_pairs(image, "--image"),
            buckets=buckets,
            clients=clients,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    for name, sent in published.uploaded.items():
        typer.echo(f"s3://{name}: {sent} bytes uploaded")
    record = published.record
    typer.echo(
        f"release {record.release} of {env}: version {published.parameter_version} of its record; bundle "
        f"{record.bundle.sha256}, model {record.model.name}@{record.model.revision} ({len(record.model.files)} "
        f"files, {record.model.size} bytes)"
    )
