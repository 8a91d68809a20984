"""The bootstrap proper: from a fresh instance holding its instance role, node.json and the bundle's venv to a
node with its secrets, registry credentials and verified model, applying the release's playbook to itself.

Phases, in order, each timed (pdstack_node_bootstrap_phase_seconds) and each idempotent, so a second boot converges
without repeating work: identity (cloud-init's instance id), access (the SSM agent node.json pins, in the cloud:
stage 0 installed it, this checks it), release (the SSM record), bundle (downloaded and checked
once per release; stage 0 did it already when it started this program), secrets, join (the node's own scheduler
token, bought with its instance role: pdstack.node.join; joining again answers the same token), registry, model,
apply. Any
failure is a BootstrapError naming its phase: the node writes the failure metric, marks itself Unhealthy so its
group replaces it, and exits non-zero. Success writes the per-phase seconds (apply's also split into image pulls,
roles and engine start), the release and the model bytes that this boot downloaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdstack.contract.components import (
    INSTANCE_TOKEN,
    NODE_EXPORTER_TEXTFILE_DIR,
    NODE_SECRETS_DIR,
    REGISTRY_AUTH_FILE,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    scheduler_audience,
    scheduler_url_parameter,
)
from pdstack.node.apply import PlaybookRun, Runner, apply_bundle, apply_parts, extra_vars, subprocess_runner
from pdstack.node.config import NodeConfig
from pdstack.node.drain import install_termination_watch
from pdstack.node.join import WAIT_FOR_CONTROL_PLANE, Joined, JoinError, JoinWait, join_scheduler
from pdstack.node.loader import (
    STATE_DIR,
    BootstrapError,
    Phase,
    aws_client,
    fetch_bundle,
    instance_id,
    metrics_text,
    operators_access,
    report_failure,
    write_metrics,
)
from pdstack.node.model_files import ModelSync, sync_model
from pdstack.node.registry import registry_auths, write_auth_file
from pdstack.node.release import ReleaseNotFoundError, ReleaseRecord, read_release, registry_host
from pdstack.node.secrets import fetch_secrets

ClientFactory = Callable[[str, str], Any]  # (service, region) -> a boto3 client
CredentialsSource = Callable[[], Any]  # -> botocore credentials: the instance role's


def instance_role_credentials() -> Any:
    """The instance role's credentials, as boto3 finds them on the instance (IMDS; the local environment's nodes:
    their environment)."""
    import boto3  # type: ignore[import-untyped]  # noqa: PLC0415 (the node venv has it; imports stay light)

    return boto3.Session().get_credentials()


@dataclass(frozen=True)
class NodePaths:
    """Where the bootstrap writes on the node (the contract's names; tests point them into a temporary folder)."""

    secrets_dir: Path = Path(NODE_SECRETS_DIR)
    registry_auth_file: Path = Path(REGISTRY_AUTH_FILE)
    textfile_dir: Path = Path(NODE_EXPORTER_TEXTFILE_DIR)
    state_dir: Path = STATE_DIR


@dataclass(frozen=True)
class BootstrapResult:
    instance_id: str
    release: str
    model: ModelSync
    playbook: PlaybookRun
    seconds: dict[str, float] = field(default_factory=dict)
    apply_parts: dict[str, float] = field(default_factory=dict)  # the apply phase: image, roles, engine_start


@contextmanager
def _phase(phase: Phase, seconds: dict[str, float], already: float = 0.0) -> Iterator[None]:
    """Time one phase; whatever stops it becomes a BootstrapError naming it (the cause's type and message: boto
    and OS errors name resources, never the secret values this program handles)."""
    started = time.monotonic()
    try:
        yield
    except BootstrapError:
        raise
    except (ReleaseNotFoundError, JoinError) as exc:
        raise BootstrapError(phase, str(exc)) from None
    except Exception as exc:
        raise BootstrapError(phase, f"{type(exc).__name__}: {exc}") from None
    finally:
        seconds[str(phase)] = already + time.monotonic() - started


def bootstrap(
    config: NodeConfig,
    *,
    client: ClientFactory | None = None,
    identify: Callable[[], str] = instance_id,
    runner: Runner = subprocess_runner,
    paths: NodePaths | None = None,
    bin_dir: Path | None = None,
    bundle_seconds: float = 0.0,
    credentials: CredentialsSource = instance_role_credentials,
    watch_termination: Callable[[Path], None] = install_termination_watch,
    join_wait: JoinWait = WAIT_FOR_CONTROL_PLANE,
) -> BootstrapResult:
    """Bring this node to its release; BootstrapError (reported as above) when it cannot."""
    paths = paths or NodePaths()
    clients: ClientFactory = client or (lambda service, region: aws_client(service, region, config.aws_endpoint_url))
    seconds: dict[str, float] = {}
    instance: str | None = None
    try:
        with _phase(Phase.IDENTITY, seconds):
            instance = identify()
        with _phase(Phase.ACCESS, seconds):
            # stage 0 installed the pinned SSM agent before anything else could fail; here only the check that
            # it is that version (nothing to do on a second run), so the phase is timed like every other
            operators_access(config.model_dump(mode="json"), paths.state_dir)
        with _phase(Phase.RELEASE, seconds):
            ssm = clients("ssm", config.control_region)
            record: ReleaseRecord = read_release(ssm, str(config.environment), config.release_parameter)
            bucket = record.bucket(config.datacenter)
        s3 = clients("s3", config.aws_region)
        with _phase(Phase.BUNDLE, seconds, bundle_seconds):
            bundle_dir = fetch_bundle(s3, bucket, record.bundle.key, record.bundle.sha256, paths.state_dir)
        with _phase(Phase.SECRETS, seconds):
            files = fetch_secrets(clients("secretsmanager", config.control_region), config, paths.secrets_dir)
        with _phase(Phase.JOIN, seconds):
            # the node's own scheduler token (instance:<role>-<instance id>), which it cannot derive: it never reads
            # the identity key. Signed for the control region's STS (the local environment's: its AWS endpoint)
            environment = str(config.environment)
            joined: Joined = join_scheduler(
                clients("ssm", config.control_region),
                scheduler_url_parameter(environment),
                credentials(),
                region=config.control_region,
                audience=scheduler_audience(environment),
                component=config.role,
                token_file=paths.secrets_dir / INSTANCE_TOKEN.file,
                sts_url=config.aws_endpoint_url.rstrip("/") + "/" if config.aws_endpoint_url else None,
                ca_file=files.tls[TLS_CA_FILE],
                client_pair=(files.tls[TLS_CERT_FILE], files.tls[TLS_KEY_FILE]),
                wait=join_wait,
            )
        with _phase(Phase.REGISTRY, seconds):
            hosts = [registry_host(image) for image in record.images.values()]
            auths = registry_auths(hosts, config.control_region, lambda region: clients("ecr", region))
            write_auth_file(paths.registry_auth_file, auths)
        with _phase(Phase.MODEL, seconds):
            model = sync_model(s3, bucket, record.model, Path(config.model_dir))
        with _phase(Phase.APPLY, seconds):
            variables = extra_vars(config, instance, record, files, paths.registry_auth_file, joined=joined)
            run = apply_bundle(bundle_dir, record, variables, paths.state_dir, runner=runner, bin_dir=bin_dir)
            if config.aws_endpoint_url is None:  # the cloud's scale-in: its group's lifecycle hook, seen in IMDS
                watch_termination(paths.state_dir)
    except BootstrapError as exc:
        report_failure(
            exc,
            seconds,
            autoscaling=clients("autoscaling", config.aws_region),
            instance=instance,
            textfile_dir=paths.textfile_dir,
        )
        raise
    parts = apply_parts(paths.state_dir, seconds[str(Phase.APPLY)])
    text = metrics_text(seconds, release=record.release, model_bytes=model.downloaded_bytes, apply_parts=parts)
    write_metrics(text, paths.textfile_dir)
    return BootstrapResult(instance, record.release, model, run, seconds, parts)
