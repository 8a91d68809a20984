"""An instance's NoCloud seed, and a node container booted from it: how the local platform launches a node the way an
Auto Scaling group launches one from its pool's launch template.

A seed is a folder cloud-init reads at /var/lib/cloud/seed/nocloud (docs: cloud-init's NoCloud datasource):

- `user-data`: the pool's user data, the very text pdstack.node.userdata renders for the launch template;
- `meta-data`: what EC2's metadata says of the instance, here its id and hostname (`cloud-init query v1.instance_id`
  answers the id, as it answers EC2's in the cloud);
- `vendor-data`: the platform's own configuration. Locally it hands the node its instance role's credentials (which
  EC2's metadata service serves in the cloud) and lets the operators' SSH key in (where a cloud node's image carries
  the SSM agent their sessions reach), so the user data stays the cloud's, byte for byte.

cloud-init merges vendor-data's cloud-config under user data's, and a top-level key both set is user data's alone
(lists are not appended): the pool's user data writes files and runs commands (`write_files`, `runcmd`), so vendor
data doing the same would silently do nothing. The credentials are written by `bootcmd` instead, which the user data
leaves alone (a test holds it to that) and which runs early in every boot, before the user data's commands.

The node image (pdstack.local.nodes) enables cloud-init only when a seed is there: a node without one boots without it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from pdstack.local import nodes
from pdstack.local.commands import run_captured

SEED_MOUNT = "/var/lib/cloud/seed/nocloud"
AWS_CREDENTIALS = "/root/.aws/credentials"
AWS_CONFIG = "/root/.aws/config"
AUTHORIZED_KEYS = Path("/root/.ssh/authorized_keys")
OUTPUT_LOG = "/var/log/cloud-init-output.log"
# the keys platform_vendor_data sets: a user data setting one of them would drop vendor data's
VENDOR_DATA_KEYS = ("bootcmd",)
# `cloud-init status`: what the node is still doing, and what ends the wait
PENDING = {"not run", "running"}


@dataclass(frozen=True)
class InstanceSeed:
    """What one instance boots with: its id and hostname (meta-data), its pool's user data and the platform's vendor
    data (None: an empty cloud-config)."""

    instance_id: str
    hostname: str
    user_data: str
    vendor_data: str | None = None


def new_instance_id() -> str:
    """An id as EC2 gives one: `i-` and 17 lowercase hex digits."""
    return "i-" + secrets.token_hex(9)[:17]


def write_seed(seed: InstanceSeed, folder: Path) -> Path:
    """Write the seed's three files into `folder` (made if missing; 0700, files 0600: vendor data may hold
    credentials); returns the folder, for launch_instance."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    meta_data = yaml.safe_dump({"instance-id": seed.instance_id, "local-hostname": seed.hostname}, sort_keys=False)
    texts = {
        "user-data": seed.user_data,
        "meta-data": meta_data,
        "vendor-data": seed.vendor_data if seed.vendor_data is not None else "#cloud-config\n",
    }
    for name, text in texts.items():
        path = folder / name
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        path.chmod(0o600)
    return folder


def platform_vendor_data(
    access_key_id: str,
    secret_access_key: str,
    session_token: str | None,
    region: str,
    operator_key: str | None = None,
) -> str:
    """Vendor data (`#cloud-config`) writing the instance role's credentials as root's AWS shared files,
    /root/.aws/credentials and /root/.aws/config (its region), both 0600, at every boot (bootcmd: see the module's
    docstring). boto3 on the node finds them as it finds the metadata service's in the cloud.

    `operator_key`: an SSH public key root's authorized_keys then holds, the operators' way in to a local node (their
    plays reach it as the AWS inventory's SSM sessions reach a cloud node, whose agent the image carries)."""
    credentials = f"[default]\naws_access_key_id = {access_key_id}\naws_secret_access_key = {secret_access_key}\n"
    if session_token:
        credentials += f"aws_session_token = {session_token}\n"
    config = f"[default]\nregion = {region}\n"
    # cloud-init quotes each word of a list command for the shell; the values are the script's arguments, never
    # part of its text, and nothing prints them
    script = (
        f'umask 077 && mkdir -p {Path(AWS_CREDENTIALS).parent} && printf "%s" "$1" > {AWS_CREDENTIALS} '
        f'&& printf "%s" "$2" > {AWS_CONFIG} && chmod 600 {AWS_CREDENTIALS} {AWS_CONFIG}'
    )
    commands = [["sh", "-c", script, "pdstack-credentials", credentials, config]]
    if operator_key is not None:
        keys = f'umask 077 && mkdir -p {AUTHORIZED_KEYS.parent} && printf "%s\\n" "$1" > {AUTHORIZED_KEYS}'
        commands.append(["sh", "-c", keys, "pdstack-operator-key", operator_key.strip()])
    document = {"bootcmd": commands}
    return (
        "#cloud-config\n# the local platform's: the instance role's credentials, the operators' key\n"
        + yaml.safe_dump(document)
    )


def launch_instance(spec: nodes.NodeSpec, seed_dir: Path) -> str:
    """Start the node container `spec` with the seed folder mounted read-only where NoCloud reads it, and return its
    name at once: cloud-init then runs the user data while the node boots (wait_for_cloud_init)."""
    missing = [name for name in ("user-data", "meta-data") if not (seed_dir / name).is_file()]
    if missing:
        raise nodes.NodeError(f"seed {seed_dir} has no {' or '.join(missing)}: write it with write_seed")
    mount = f"{seed_dir.resolve()}:{SEED_MOUNT}:ro"
    return nodes.create_node(replace(spec, extra_args=(*spec.extra_args, "--volume", mount)), wait=False)


def cloud_init_status(name: str) -> str:
    """cloud-init's status in the node for this boot: `not run` (yet), `running`, `done`, `error`, or `disabled`
    (no seed); NodeError when the node does not answer (stopped, or no cloud-init)."""
    answer = run_captured(["podman", "exec", name, "cloud-init", "status", "--format", "json"], check=False)
    try:
        return str(json.loads(answer.stdout)["status"])
    except (ValueError, KeyError, TypeError):
        reason = nodes.stopped_reason(name)
        detail = f"it stopped: {reason}" if reason else (answer.stdout + answer.stderr).strip()[-1000:]
        raise nodes.NodeError(f"no cloud-init status from node {name}: {detail}") from None


def wait_for_cloud_init(name: str, timeout: float = 600.0, interval: float = 1.0) -> None:
    """Poll cloud-init's status in the node until it is done with this boot; NodeError, with `cloud-init status
    --long` and the end of its output log, when it ends in error, is disabled (the node found no seed) or is not
    done within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    status = cloud_init_status(name)
    while status in PENDING and time.monotonic() < deadline:
        time.sleep(interval)
        status = cloud_init_status(name)
    if status == "done":
        return
    what = f"not done after {timeout:.0f}s" if status in PENDING else status
    raise nodes.NodeError(f"cloud-init in node {name}: {what}\n{_report(name)}")


def _report(name: str) -> str:
    long = run_captured(["podman", "exec", name, "cloud-init", "status", "--long"], check=False)
    tail = run_captured(["podman", "exec", name, "tail", "-n", "30", OUTPUT_LOG], check=False)
    return f"{long.stdout.strip()}\n{OUTPUT_LOG} ends:\n{(tail.stdout + tail.stderr).strip()}"
