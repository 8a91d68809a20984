"""Node containers: fresh Debian 12 hosts made of podman containers, for role tests and the local stack.

No public image registry is reachable from these machines, so the base image is built from Debian packages with
`debootstrap --variant=minbase` and imported into podman; a node image adds systemd (as PID 1, so services such as
chrony really run), python3 for Ansible, cloud-init (as a cloud image has it: a node booted with a NoCloud seed runs
its pool's user data, pdstack.local.cloud_seed; one without a seed leaves cloud-init disabled) and nothing else a
role is expected to install. Both builds are skipped when the image already exists, since debootstrap is the slow
step; the node image's tag is a hash of what it is built from (NODE_IMAGE), so a changed recipe builds a new one.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pdstack.local import procs
from pdstack.local.commands import CommandError, run_captured

BASE_IMAGE = "localhost/pdstack-debian12-base:latest"
NODE_REPOSITORY = "localhost/pdstack-node"
# A GPU node from launch to ready, booting from its user data beside the others and the control plane's converge:
# packages, a 100 MB bundle, a venv installed offline, the model and the roles, on 2 cores
BOOT_TIMEOUT_S = 1200
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"

# What a freshly provisioned Debian 12 cloud node has: an init system, python3 for Ansible and the basic tools.
# openssh-server: Ansible reaches nodes over SSH as it reaches real ones (and SSH pipelining is several times faster
# than a podman exec per step). cloud-init: a cloud image's, which runs the user data (here from a NoCloud seed).
# Everything the baseline roles configure (chrony, podman, mdadm, ...) is left out.
NODE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "python3",
    "python3-apt",
    "iproute2",
    "procps",
    "kmod",
    "udev",
    "util-linux",
    "ca-certificates",
    "openssh-server",
    "cloud-init",
)

# cloud-init looks for a NoCloud seed only (/var/lib/cloud/seed/nocloud, what pdstack.local.cloud_seed mounts), never
# for a metadata service. ds-identify takes a list of one datasource (with or without None) as found without looking,
# and cloud-init would then run every module on an empty configuration (a default user, new SSH host keys, ...); with
# two entries it searches, and finding neither seed disables cloud-init for that boot (notfound=disabled, which
# ds-identify.cfg makes the policy on every architecture): a node without a seed boots as it did before cloud-init.
# The container's network is podman's and the image's apt sources are the reachable mirror: cloud-init changes
# neither (Debian's cloud.cfg already preserves sources.list).
NODE_CLOUD_CFG = """\
# pdstack/local/nodes.py: a node container's datasource is its NoCloud seed, if it has one
datasource_list: [NoCloud, ConfigDrive]
network: {config: disabled}
"""
NODE_DS_IDENTIFY_CFG = """\
policy: search,found=all,maybe=none,notfound=disabled
"""

NODE_CONTAINERFILE = """\
FROM {base}
ENV DEBIAN_FRONTEND=noninteractive container=podman
RUN printf 'deb {mirror} {suite} main\\ndeb {mirror} {suite}-updates main\\n' > /etc/apt/sources.list \\
 && apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends {packages} \\
 && apt-get clean && rm -rf /var/lib/apt/lists/* \\
 && touch -d 2000-01-01 /var/lib/apt/lists
# The package lists are dropped (and dated old so a role's cache_valid_time refreshes them), as on a cloud image.
# Units that make no sense in a container and only slow the boot down.
RUN systemctl mask systemd-udevd.service systemd-udevd-kernel.socket systemd-udevd-control.socket \\
    getty.target console-getty.service systemd-logind.service
COPY 90-pdstack.cfg /etc/cloud/cloud.cfg.d/90-pdstack.cfg
COPY ds-identify.cfg /etc/cloud/ds-identify.cfg
STOPSIGNAL SIGRTMIN+3
CMD ["/sbin/init"]
"""


def node_image_tag() -> str:
    """The node image's reference: NODE_REPOSITORY tagged `src-` and 12 hex digits of a hash of its recipe (the
    Containerfile, the packages, the files it copies; not the mirror, which differs by host and not in content)."""
    digest = hashlib.sha256()
    for part in (NODE_CONTAINERFILE, " ".join(NODE_PACKAGES), NODE_CLOUD_CFG, NODE_DS_IDENTIFY_CFG):
        digest.update(part.encode() + b"\0")
    return f"{NODE_REPOSITORY}:src-{digest.hexdigest()[:12]}"


NODE_IMAGE = node_image_tag()


class NodeError(RuntimeError):
    """A node or its image is not as it should be (a command that fails raises CommandError instead)."""


@dataclass(frozen=True)
class NodeSpec:
    """One node container: its name (also its hostname) and extra podman run arguments."""

    name: str
    image: str = NODE_IMAGE
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def volume(self) -> str:
        """The named volume holding the node's /var/lib/containers (podman-in-podman needs a real filesystem)."""
        return f"{self.name}-containers"


def host_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror the host's apt uses, so debootstrap and the node image reach the same (reachable) one."""
    candidates = [sources_dir / "sources.list", *sorted((sources_dir / "sources.list.d").glob("*"))]
    for path in candidates:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            uris = [w for w in words if w.startswith(("http://", "https://"))]
            if line.lstrip().startswith(("URIs:", "deb ")) and uris and uris[0].rstrip("/").endswith("/debian"):
                return uris[0].rstrip("/")
    return DEFAULT_MIRROR


def image_exists(image: str) -> bool:
    return run_captured(["podman", "image", "exists", image], check=False).returncode == 0


@contextmanager
def build_lock(image: str) -> Iterator[None]:
    """Held while `image` is built: a second builder on this machine (another test lane, a second `up`) waits, then
    finds the image there instead of building it again beside the first."""
    name = hashlib.sha256(image.encode()).hexdigest()[:16]
    with (Path(tempfile.gettempdir()) / f"pdstack-build-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_base_image(image: str = BASE_IMAGE, mirror: str | None = None) -> str:
    """Debootstrap a minimal Debian 12 root and import it as `image`; skipped when the image exists."""
    with build_lock(image):
        if not image_exists(image):
            _debootstrap(image, mirror)
    return image


def _debootstrap(image: str, mirror: str | None) -> None:
    if shutil.which("debootstrap") is None:
        raise NodeError("debootstrap is not installed; run scripts/host-setup.sh first")
    with tempfile.TemporaryDirectory(prefix="pdstack-rootfs-") as root:
        run_captured(["debootstrap", "--variant=minbase", SUITE, root, mirror or host_mirror()])
        _import_tree(root, image)


def _import_tree(root: str, image: str) -> None:
    """`tar -C root -c . | podman import - image`, without a shell; either side failing raises CommandError."""
    pack, load = ["tar", "-C", root, "-c", "."], ["podman", "import", "-", image]
    with tempfile.TemporaryFile() as tar_errors:  # a file, not a pipe: tar never blocks on it while podman reads
        tar = subprocess.Popen(pack, stdout=subprocess.PIPE, stderr=tar_errors)
        assert tar.stdout is not None
        imported = subprocess.run(load, stdin=tar.stdout, capture_output=True, text=True, errors="replace", check=False)
        tar.stdout.close()
        if tar.wait() != 0:  # podman imports what it got: a truncated root must not pass for the base image
            run_captured(["podman", "rmi", image], check=False)
            tar_errors.seek(0)
            raise CommandError(pack, tar.returncode, tar_errors.read().decode(errors="replace"))
    if imported.returncode != 0:
        raise CommandError(load, imported.returncode, imported.stdout + imported.stderr)


def build_node_image(image: str = NODE_IMAGE, base: str = BASE_IMAGE, mirror: str | None = None) -> str:
    """Build the node image (systemd, python3, cloud-init) on top of the base image; both are skipped when they
    exist. Building NODE_IMAGE untags the repository's other builds (an image a container still runs stays)."""
    with build_lock(image):
        if not image_exists(image):
            _build_node_image(image, base, mirror)
    return image


def _build_node_image(image: str, base: str, mirror: str | None) -> None:
    build_base_image(base, mirror)
    containerfile = NODE_CONTAINERFILE.format(
        base=base, mirror=mirror or host_mirror(), suite=SUITE, packages=" ".join(NODE_PACKAGES)
    )
    with tempfile.TemporaryDirectory(prefix="pdstack-node-build-") as context:
        (Path(context) / "Containerfile").write_text(containerfile)
        (Path(context) / "90-pdstack.cfg").write_text(NODE_CLOUD_CFG)
        (Path(context) / "ds-identify.cfg").write_text(NODE_DS_IDENTIFY_CFG)
        run_captured(["podman", "build", "--network", "host", "-t", image, context])
    if image == NODE_IMAGE:
        _untag_older_node_images(image)


def _untag_older_node_images(image: str) -> None:
    listed = run_captured(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}", NODE_REPOSITORY], check=False)
    older = [tag for tag in listed.stdout.split() if tag != image and tag.startswith(f"{NODE_REPOSITORY}:")]
    for tag in older:  # one at a time: podman refuses an image a container uses, and would skip the rest with it
        run_captured(["podman", "rmi", tag], check=False)


def create_node(spec: NodeSpec, *, wait: bool = True) -> str:
    """Start a privileged node container running systemd as PID 1; returns its name once systemd finished booting,
    or at once without `wait` (a node whose boot runs long jobs, such as cloud-init's, is waited for otherwise)."""
    remove_node(spec.name)
    run_captured(
        [
            "podman",
            "run",
            "-d",
            "--name",
            spec.name,
            "--hostname",
            spec.name,
            "--privileged",
            "--systemd=always",
            "--volume",
            f"{spec.volume}:/var/lib/containers",
            *spec.extra_args,
            spec.image,
        ]
    )
    if wait:
        wait_for_systemd(spec.name)
    return spec.name


def wait_for_systemd(name: str, attempts: int = 120) -> None:
    """Block until systemd inside the node finished booting (running or degraded)."""
    for _ in range(attempts):
        state = run_captured(["podman", "exec", name, "systemctl", "is-system-running"], check=False)
        if state.stdout.strip() in {"running", "degraded"}:
            return
        time.sleep(1)
    raise NodeError(f"systemd in node {name} did not finish booting")


def node_running(name: str) -> bool:
    """Whether the node's init runs: podman says so and its process exists. podman's record alone outlives a node
    whose processes were killed without podman (its conmon with them, as when a session's processes all end): such
    a node is "running" to `podman ps` while every exec in it fails with "cannot exec in a stopped container"."""
    state = run_captured(["podman", "inspect", "--format", "{{.State.Running}} {{.State.Pid}}", name], check=False)
    running, _, pid = state.stdout.strip().partition(" ")
    return running == "true" and pid.isdigit() and procs.alive(int(pid))


def stopped_reason(name: str) -> str | None:
    """None while the node runs; otherwise its exit state and the tail of its console (systemd's boot and shutdown
    messages), for an error that says why it stopped."""
    if node_running(name):
        return None
    template = "running={{.State.Running}} exit={{.State.ExitCode}} oom={{.State.OOMKilled}} error={{.State.Error}}"
    state = run_captured(["podman", "inspect", "--format", template, name], check=False).stdout.strip()
    logs = run_captured(["podman", "logs", "--tail", "25", name], check=False)
    console = (logs.stdout + logs.stderr).strip()
    return f"{state or 'no such container'}; its console ends:\n{console}"


def node_exists(name: str) -> bool:
    return run_captured(["podman", "container", "exists", name], check=False).returncode == 0


def remove_node(name: str) -> None:
    """Remove the node container and its containers volume if they exist."""
    if node_exists(name):
        removed = run_captured(["podman", "rm", "-f", "-t", "5", name], check=False)
        if removed.returncode != 0:  # a node killed behind podman's back: the failed stop marked it stopped
            run_captured(["podman", "rm", "-f", "-t", "0", name])
    run_captured(["podman", "volume", "rm", "-f", f"{name}-containers"], check=False)


def exec_in_node(name: str, command: Sequence[str]) -> str:
    """Run a command in the node and return its standard output."""
    return run_captured(["podman", "exec", name, *command]).stdout


def ensure_ssh_key(path: Path) -> Path:
    """Create an ed25519 key pair at `path` (private) and `path`.pub unless it exists; returns the private key path."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        run_captured(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pdstack-nodes", "-f", str(path)])
    return path


def authorize_ssh_key(name: str, public_key: str) -> None:
    """Let the holder of `public_key` log into the node as root."""
    run_captured(
        [
            "podman",
            "exec",
            "-i",
            name,
            "sh",
            "-c",
            "install -d -m 700 /root/.ssh && cat > /root/.ssh/authorized_keys && chmod 600 /root/.ssh/authorized_keys",
        ],
        stdin=public_key,
    )


def node_address(name: str) -> str:
    """The node's IPv4 address on its first container network."""
    template = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
    addresses = run_captured(["podman", "inspect", "--format", template, name]).stdout.split()
    if not addresses:
        raise NodeError(f"node {name} has no IP address")
    return addresses[0]
