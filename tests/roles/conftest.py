"""Fresh Debian 12 node containers converged with playbooks/baseline.yml, shared by the role tests.

The session builds the node image once (cached in podman's store), starts two nodes, gives node A a real block device
(a loop device over a sparse file, standing in for an instance-store NVMe disk), runs the baseline twice and keeps
both recaps for the tests to assert on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.local import nodes
from pdstack.local.registry import NODE_AUTH_FILE
from tests.support import REPO
from tests.support.ansible import ANSIBLE_PLAYBOOK, PlaybookRun

PLAYBOOK = REPO / "playbooks" / "baseline.yml"
# Unique per test process: two test sessions on one machine (a developer's and CI's) must not share nodes.
NODE_A = f"pdstack-role-a-{os.getpid()}"
NODE_B = f"pdstack-role-b-{os.getpid()}"
DISK_BYTES = 512 * 1024 * 1024

# Test settings: every address a node may talk to is its own loopback or the nodes' own network.
TEST_VARS: dict[str, Any] = {
    "ansible_user": "root",
    "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
    "ansible_ssh_pipelining": True,
    "ansible_become": False,
    "time_sync_pools": [],
    "time_sync_servers": ["127.0.0.1"],
    "time_sync_allow": ["127.0.0.1"],
    "time_sync_local_stratum": 10,
    "kernel_tuning_link_bandwidth_gbps": 25.0,
    "kernel_tuning_link_rtt_ms": 40.0,
    "numa_hugepages_2m": 512,
    "numa_serving_nics": ["eth0"],
    "container_runtime_oci_runtime": "runc",
    "container_runtime_cgroup_manager": "cgroupfs",
    "container_runtime_events_logger": "file",
    "container_runtime_default_ulimits": ["nofile=20000:20000", "nproc=4096:4096"],
    "container_runtime_registries": [
        {"location": "registry.pdstack.test:5000", "insecure": True, "mirrors": ["mirror.pdstack.test:5000"]}
    ],
    "container_runtime_registry_auths": [
        {"registry": "registry.pdstack.test:5000", "username": "pdstack", "password": "test-only-password"}
    ],
    "container_runtime_auth_file": NODE_AUTH_FILE,  # as `up` gives it: a folder the node image does not have
    # Any accidental fetch from the NVIDIA repositories goes to a closed loopback port, never out.
    "gpu_driver_cuda_repo_url": "http://127.0.0.1:9/cuda/",
    "gpu_driver_cuda_repo_key_url": "http://127.0.0.1:9/cuda/key.pub",
    "gpu_driver_toolkit_repo_url": "http://127.0.0.1:9/toolkit/",
    "gpu_driver_toolkit_repo_key_url": "http://127.0.0.1:9/toolkit/gpgkey",
}


@dataclass
class Cluster:
    """The converged nodes and what it took to get there."""

    inventory: Path
    workdir: Path
    first_run: PlaybookRun
    second_run: PlaybookRun
    disk: str

    def playbook(self, *args: str, playbook: Path = PLAYBOOK) -> PlaybookRun:
        return run_playbook(self.inventory, playbook, *args)


def run_playbook(inventory: Path, playbook: Path, *args: str) -> PlaybookRun:
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(inventory), str(playbook), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "HOME": str(inventory.parent),
            "ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.profile_tasks",
        },
    )
    return PlaybookRun(result.returncode, result.stdout + result.stderr)


def attach_loop_device(image: Path, size: int = DISK_BYTES) -> str:
    """A fresh blank block device backed by a sparse file (what a new instance-store disk looks like)."""
    image.unlink(missing_ok=True)
    with image.open("wb") as handle:
        handle.truncate(size)
    return subprocess.run(
        ["losetup", "-f", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()


def detach_loop_device(device: str) -> None:
    subprocess.run(["losetup", "-d", device], check=False)


def write_inventory(workdir: Path, key: Path, hosts: dict[str, dict[str, Any]]) -> Path:
    inventory = workdir / "hosts.yml"
    group_vars = {**TEST_VARS, "ansible_ssh_private_key_file": str(key)}
    inventory.write_text(yaml.safe_dump({"nodes": {"hosts": hosts, "vars": group_vars}}))
    return inventory


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("podman") is None or shutil.which("debootstrap") is None:
        subprocess.run(["bash", str(REPO / "scripts" / "host-setup.sh")], check=True)
    nodes.build_node_image()
    workdir = tmp_path_factory.mktemp("roles")
    key = nodes.ensure_ssh_key(workdir / "id_ed25519")
    disk = attach_loop_device(workdir / "nvme0.img")
    try:
        hosts: dict[str, dict[str, Any]] = {}
        for name in (NODE_A, NODE_B):
            nodes.create_node(nodes.NodeSpec(name))
            nodes.authorize_ssh_key(name, key.with_suffix(".pub").read_text())
            hosts[name] = {"ansible_host": nodes.node_address(name)}
        hosts[NODE_A]["storage_nvme_devices"] = [disk]
        inventory = write_inventory(workdir, key, hosts)
        first = run_playbook(inventory, PLAYBOOK)
        (workdir / "first_run.log").write_text(first.output)
        second = run_playbook(inventory, PLAYBOOK) if first.returncode == 0 else first
        (workdir / "second_run.log").write_text(second.output)
        yield Cluster(inventory, workdir, first, second, disk)
    finally:
        for name in (NODE_A, NODE_B):
            nodes.remove_node(name)
        detach_loop_device(disk)
