"""Stage 0 of a node's bootstrap: what runs before pdstack is on the node, and how any failure is reported.

The node image is the distribution's own (Debian 12), so pdstack is not on it: the user data carries this module's
source (pdstack/node/userdata.py) and a systemd unit that runs it at every boot. It reads /etc/pdstack/node.json,
reads the release record's node bundle from SSM, downloads the bundle from the datacenter's bucket, checks its sha256,
unpacks it, installs its wheels offline into a venv (pdstack, its dependencies, ansible-core) and replaces itself
with `python -m pdstack.node bootstrap` from that venv. A second boot of the same release finds the bundle unpacked
and the venv installed and goes straight on.

It may use only the standard library and boto3 (Debian's python3-boto3): no pydantic, no other pdstack module. The
bootstrap proper imports the failure reporting from here, so a node reports a failed stage 0 and a failed phase
the same way: BootstrapError names the phase; the node writes `pdstack_node_bootstrap_failed{phase=...} 1` for
node_exporter's textfile collector and marks itself Unhealthy in its Auto Scaling group, which replaces it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

NODE_CONFIG = Path("/etc/pdstack/node.json")
STATE_DIR = Path("/var/lib/pdstack/node")  # unpacked bundles by sha256, the venvs installed from them
METRICS_FILE = "pdstack_node_bootstrap.prom"
METRIC_PREFIX = "pdstack_node_bootstrap_"
# Kept equal to pdstack.contract.components.NODE_EXPORTER_TEXTFILE_DIR by a test: this module imports no pdstack
TEXTFILE_DIR = Path("/var/lib/prometheus/node-exporter")
CHUNK = 8 << 20
# Inside the bundle (pdstack/node/bundle.py): the wheels, and what to install of them (pdstack, pdserve, ansible-core
# and boto3, pinned; their dependencies come along)
WHEELS = "wheels"
# The SSM agent (the operators' way in, amazon.aws.aws_ssm): Debian's image has none. AWS's regional S3 distribution
# of the .deb, by the version and sha256 node.json's `ssm_agent` pins (pdstack-infra:ssm_agent_version and
# ssm_agent_sha256, docs/cloud.md); a node whose node.json pins none (the local environment's) installs nothing.
SSM_AGENT_PACKAGE = "amazon-ssm-agent"
SSM_AGENT_URL = "https://s3.{region}.amazonaws.com/amazon-ssm-{region}/{version}/debian_amd64/amazon-ssm-agent.deb"
SSM_AGENT_VERSION = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
REQUIREMENTS = "wheels/requirements.txt"
# STATE_DIR/venv: the venv of the bundle this node runs, for what runs pdstack on the node after the bootstrap
# (`venv/bin/python -m pdstack.node drain`: the termination watch in the cloud, `pdstack local scale` locally)
CURRENT_VENV = "venv"


class Phase(StrEnum):
    """The bootstrap's phases in order; each is timed and each failure names one."""

    IDENTITY = "identity"
    ACCESS = "access"  # the operators' way in: the SSM agent, installed in the cloud (stage 0: this module)
    RELEASE = "release"
    BUNDLE = "bundle"  # the node bundle and the venv it installs (stage 0: this module)
    SECRETS = "secrets"
    JOIN = "join"  # the node's own scheduler token, bought with its instance role (pdstack.node.join)
    REGISTRY = "registry"
    MODEL = "model"
    APPLY = "apply"


class BootstrapError(RuntimeError):
    """A bootstrap that cannot go on: the phase and the cause, never a secret's value."""

    def __init__(self, phase: Phase, cause: str) -> None:
        super().__init__(f"bootstrap failed in phase {phase}: {cause}")
        self.phase = phase
        self.cause = cause


def aws_client(service: str, region: str, endpoint_url: str | None) -> Any:
    """A boto3 client on the instance role's credentials; `endpoint_url` is the local environment's AWS (moto)."""
    import boto3  # type: ignore[import-untyped]  # noqa: PLC0415 (Debian's python3-boto3, loaded when first used)

    return boto3.client(service, region_name=region, endpoint_url=endpoint_url)


def read_node_config(path: Path = NODE_CONFIG) -> dict[str, Any]:
    return dict(json.loads(path.read_text(encoding="utf-8")))


def instance_id(run: Any = subprocess.run) -> str:
    """This instance's id as cloud-init knows it: from EC2's metadata in the cloud, from the NoCloud seed's
    meta-data locally, through the same command."""
    answer = run(["cloud-init", "query", "v1.instance_id"], capture_output=True, text=True, check=False)
    value = answer.stdout.strip()
    if answer.returncode != 0 or not value:
        raise BootstrapError(Phase.IDENTITY, f"cloud-init query v1.instance_id failed: {answer.stderr.strip()}")
    return str(value)


# -- reporting ---------------------------------------------------------------------------------------------------
def write_metrics(text: str, directory: Path = TEXTFILE_DIR) -> Path:
    """Replace the bootstrap's metrics file atomically (node_exporter never reads half of it)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / METRICS_FILE
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{METRICS_FILE}.")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    return target


def metrics_text(
    seconds: Mapping[str, float],
    *,
    failed: str | None = None,
    release: str | None = None,
    model_bytes: int | None = None,
    apply_parts: Mapping[str, float] | None = None,
    now: float | None = None,
) -> str:
    """The bootstrap's metrics in Prometheus' text format: per-phase seconds always; then either the failed phase or
    the success time, the release, the model bytes downloaded and the apply phase's parts."""
    lines = [
        "# HELP pdstack_node_bootstrap_phase_seconds How long each bootstrap phase of this boot took.",
        "# TYPE pdstack_node_bootstrap_phase_seconds gauge",
        *(f'pdstack_node_bootstrap_phase_seconds{{phase="{p}"}} {s:.3f}' for p, s in seconds.items()),
        "# HELP pdstack_node_bootstrap_failed 1 when this boot's bootstrap failed, labelled with the phase.",
        "# TYPE pdstack_node_bootstrap_failed gauge",
    ]
    if failed is not None:
        lines.append(f'pdstack_node_bootstrap_failed{{phase="{failed}"}} 1')
    else:
        lines += [
            "pdstack_node_bootstrap_failed 0",
            "# HELP pdstack_node_bootstrap_success_timestamp_seconds When this node's bootstrap last succeeded.",
            "# TYPE pdstack_node_bootstrap_success_timestamp_seconds gauge",
            f"pdstack_node_bootstrap_success_timestamp_seconds {time.time() if now is None else now:.3f}",
        ]
        if release is not None:
            lines += [
                "# HELP pdstack_node_bootstrap_release_info The release this node bootstrapped.",
                "# TYPE pdstack_node_bootstrap_release_info gauge",
                f'pdstack_node_bootstrap_release_info{{release="{release}"}} 1',
            ]
        if model_bytes is not None:
            lines += [
                "# HELP pdstack_node_bootstrap_model_downloaded_bytes Model bytes this boot downloaded.",
                "# TYPE pdstack_node_bootstrap_model_downloaded_bytes gauge",
                f"pdstack_node_bootstrap_model_downloaded_bytes {model_bytes}",
            ]
        if apply_parts:
            lines += [
                "# HELP pdstack_node_bootstrap_apply_seconds Seconds of the apply phase: pulls, roles, engine start.",
                "# TYPE pdstack_node_bootstrap_apply_seconds gauge",
                *(f'pdstack_node_bootstrap_apply_seconds{{part="{p}"}} {s:.3f}' for p, s in apply_parts.items()),
            ]
    return "\n".join(lines) + "\n"


def read_metrics(text: str) -> dict[str, dict[str, float]]:
    """What metrics_text wrote, by family without the `pdstack_node_bootstrap_` prefix, then by its one label's value
    ("" for a family without labels): {"phase_seconds": {"release": 0.2, ...}, "model_downloaded_bytes": {"": 12.0}}."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith(METRIC_PREFIX):
            name, _, value = line.removeprefix(METRIC_PREFIX).rpartition(" ")
            family, _, labels = name.partition("{")
            found.setdefault(family, {})[labels.split('"')[1] if labels else ""] = float(value)
    return found


def mark_unhealthy(autoscaling: Any, instance: str) -> None:
    """Tell the instance's Auto Scaling group to replace it now (not after the health check grace period)."""
    autoscaling.set_instance_health(InstanceId=instance, HealthStatus="Unhealthy", ShouldRespectGracePeriod=False)


def report_failure(
    error: BootstrapError,
    seconds: Mapping[str, float],
    *,
    autoscaling: Any,
    instance: str | None,
    textfile_dir: Path = TEXTFILE_DIR,
) -> None:
    """Say loudly that this node failed: the metric first (it needs nothing), then the group. A failure to report
    is printed and does not hide the bootstrap's own error."""
    print(f"pdstack-node: {error}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        write_metrics(metrics_text(seconds, failed=str(error.phase)), textfile_dir)
    if instance is None:
        print("pdstack-node: instance id unknown: cannot mark it unhealthy", file=sys.stderr, flush=True)
        return
    try:
        mark_unhealthy(autoscaling, instance)
    except Exception as exc:
        print(f"pdstack-node: could not mark {instance} unhealthy: {exc}", file=sys.stderr, flush=True)


# -- the operators' way in ---------------------------------------------------------------------------------------
def ssm_agent_url(region: str, version: str) -> str:
    return SSM_AGENT_URL.format(region=region, version=version)


def _download(url: str, target: Path) -> None:
    if not url.startswith("https://"):
        raise ValueError(f"{url} is not https")
    with urllib.request.urlopen(url, timeout=120) as answer, target.open("wb") as out:  # noqa: S310 (https only)
        shutil.copyfileobj(answer, out, CHUNK)


def install_ssm_agent(
    pin: Mapping[str, str],
    region: str,
    state_dir: Path = STATE_DIR,
    run: Any = subprocess.run,
    download: Callable[[str, Path], None] = _download,
) -> bool:
    """The SSM agent of the pinned version, installed from AWS's regional distribution of the .deb when the node
    has another version or none, its sha256 checked before dpkg sees it; True when it installed. Any failure, a
    sha256 mismatch first, is a BootstrapError of phase access."""
    version, sha256 = pin.get("version", ""), pin.get("sha256", "")
    if not SSM_AGENT_VERSION.match(version) or not SHA256.match(sha256):
        raise BootstrapError(Phase.ACCESS, f"node.json's ssm_agent pin {dict(pin)!r} is not a version and a sha256")
    query = [*("dpkg-query", "--show", "--showformat=${Version}"), SSM_AGENT_PACKAGE]
    installed = run(query, capture_output=True, text=True, check=False)
    if installed.returncode == 0 and installed.stdout.strip().split("-", 1)[0] == version:
        return False
    url = ssm_agent_url(region, version)
    state_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=state_dir, prefix=".ssm-agent-") as work:
        deb = Path(work) / "amazon-ssm-agent.deb"
        try:
            download(url, deb)
        except Exception as exc:
            raise BootstrapError(Phase.ACCESS, f"cannot download {url}: {exc}") from None
        got = file_sha256(deb)
        if got != sha256:
            raise BootstrapError(
                Phase.ACCESS,
                f"{url} has sha256 {got}, node.json's ssm_agent pin (pdstack-infra:ssm_agent_sha256) "
                f"says {sha256}: not installed",
            )
        for step in (["dpkg", "--install", str(deb)], ["systemctl", "enable", "--now", SSM_AGENT_PACKAGE]):
            answer = run(step, capture_output=True, text=True, check=False)
            if answer.returncode != 0:
                raise BootstrapError(Phase.ACCESS, f"{' '.join(step)} failed: {answer.stderr.strip()[-2000:]}")
    return True


def operators_access(config: Mapping[str, Any], state_dir: Path = STATE_DIR, **install: Any) -> None:
    """In the cloud (no aws_endpoint_url), the SSM agent node.json pins; locally nothing (no SSM to register with)."""
    pin = config.get("ssm_agent")
    if config.get("aws_endpoint_url") is not None:
        return
    if pin is None:
        print(
            "pdstack-node: node.json pins no SSM agent (pdstack-infra:ssm_agent_version, ssm_agent_sha256): "
            "no operator's session can reach this node",
            file=sys.stderr,
            flush=True,
        )
        return
    install_ssm_agent(pin, config["aws_region"], state_dir, **install)


# -- the bundle --------------------------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        while block := data.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def fetch_bundle(s3: Any, bucket: str, key: str, sha256: str, state_dir: Path = STATE_DIR) -> Path:
    """The bundle unpacked under state_dir/bundles/<sha256>, downloaded and checked only when it is not there yet.
    Unpacked beside its final place and renamed into it: a directory of that name is always complete."""
    target = state_dir / "bundles" / sha256
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".partial-") as work:
        archive = Path(work) / "bundle.tar.gz"
        try:
            s3.download_file(bucket, key, str(archive))
        except Exception as exc:
            raise BootstrapError(Phase.BUNDLE, f"cannot download s3://{bucket}/{key}: {exc}") from None
        got = file_sha256(archive)
        if got != sha256:
            raise BootstrapError(Phase.BUNDLE, f"s3://{bucket}/{key} has sha256 {got}, the release says {sha256}")
        unpacked = Path(work) / "unpacked"
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, members=_plain_members(tar, key))  # noqa: S202 (members checked)
        unpacked.rename(target)
    return target


def _plain_members(tar: tarfile.TarFile, key: str) -> list[tarfile.TarInfo]:
    """The archive's members when every one is a plain file or folder inside it (Debian 12's Python 3.11.2 has no
    extraction filters): no absolute path, no .., no link or device."""
    members = tar.getmembers()
    for member in members:
        parts = Path(member.name).parts
        if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
            raise BootstrapError(Phase.BUNDLE, f"{key}: {member.name!r} is not a plain file or folder inside it")
        member.mode &= 0o755
    return members


def install_venv(bundle: Path, state_dir: Path = STATE_DIR, run: Any = subprocess.run) -> Path:
    """The venv of this bundle (its wheels' requirements, offline, beside Debian's boto3), installed once."""
    venv = state_dir / "venvs" / bundle.name
    python = venv / "bin" / "python"
    if (venv / ".installed").exists():
        _point(state_dir / CURRENT_VENV, venv)
        return python
    steps = [
        [sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv)],
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-compile",  # byte-compiled as imported: the few modules a node runs, not every file (27 s -> 14 s)
            "--no-index",
            "--find-links",
            str(bundle / WHEELS),
            "-r",
            str(bundle / REQUIREMENTS),
        ],
    ]
    for step in steps:
        answer = run(step, capture_output=True, text=True, check=False)
        if answer.returncode != 0:
            raise BootstrapError(Phase.BUNDLE, f"{' '.join(step[:4])} failed: {answer.stderr.strip()[-2000:]}")
    (venv / ".installed").touch()
    _point(state_dir / CURRENT_VENV, venv)
    return python


def _point(link: Path, target: Path) -> None:
    """`link` -> `target`, replaced atomically (a reader finds the old venv or the new one, never none)."""
    fresh = link.with_name(f".{link.name}.new")
    fresh.unlink(missing_ok=True)
    fresh.symlink_to(target)
    fresh.replace(link)


def main(
    config_path: Path = NODE_CONFIG,
    *,
    state_dir: Path = STATE_DIR,
    textfile_dir: Path = TEXTFILE_DIR,
    identify: Callable[[], str] = instance_id,
) -> int:
    """Stage 0; on success it becomes the bootstrap (exec), on failure it reports and returns 1."""
    started = time.monotonic()
    config = read_node_config(config_path)
    endpoint = config.get("aws_endpoint_url")
    instance: str | None = None
    try:
        instance = identify()
        operators_access(config, state_dir)
        ssm = aws_client("ssm", config["control_region"], endpoint)
        try:
            record = json.loads(ssm.get_parameter(Name=config["release_parameter"])["Parameter"]["Value"])
        except ssm.exceptions.ParameterNotFound:
            raise BootstrapError(Phase.RELEASE, f"SSM parameter {config['release_parameter']} does not exist") from None
        bundle = record["bundle"]
        bucket = record["buckets"][config["datacenter"]]
        s3 = aws_client("s3", config["aws_region"], endpoint)
        unpacked = fetch_bundle(s3, bucket, bundle["key"], bundle["sha256"], state_dir)
        python = install_venv(unpacked, state_dir)
    except Exception as exc:
        error = exc if isinstance(exc, BootstrapError) else BootstrapError(Phase.BUNDLE, f"{type(exc).__name__}: {exc}")
        seconds = {str(Phase.BUNDLE): time.monotonic() - started}
        autoscaling = aws_client("autoscaling", config["aws_region"], endpoint)
        report_failure(error, seconds, autoscaling=autoscaling, instance=instance, textfile_dir=textfile_dir)
        return 1
    argv = [str(python), "-m", "pdstack.node", "bootstrap", "--config", str(config_path)]
    argv += ["--bundle-seconds", f"{time.monotonic() - started:.3f}"]
    os.execv(argv[0], argv)  # noqa: S606 (the venv's own python, from the bundle this module checked)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else NODE_CONFIG))
