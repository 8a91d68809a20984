"""Paths that need a GPU or several real disks, run in check mode against a converged node.

Check mode proves the decisions (what is installed, created, mounted), the rendered files (--diff) and that nothing
was changed on the node; the NVIDIA package installs, service starts and mdadm/mkfs runs themselves only happen on
real hardware.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import testinfra

from tests.roles.conftest import NODE_A, NODE_B, Cluster, attach_loop_device, detach_loop_device

pytestmark = pytest.mark.timeout(1500)


def extra_vars(values: dict[str, object]) -> tuple[str, str]:
    return "-e", json.dumps(values)


@pytest.mark.parametrize(
    ("nvswitch", "expected_packages"),
    [
        (True, "nvidia-open-570, nvidia-fabricmanager-570, nvidia-container-toolkit"),
        (False, "nvidia-open-570, nvidia-container-toolkit"),
    ],
)
def test_gpu_path_in_check_mode(cluster: Cluster, nvswitch: bool, expected_packages: str) -> None:
    run = cluster.playbook(
        "--check",
        "--diff",
        "--limit",
        NODE_B,
        "--tags",
        "gpu_driver",
        *extra_vars({"gpu_driver_force_gpu_present": True, "gpu_driver_force_nvswitch_present": nvswitch}),
    )
    assert run.returncode == 0, run.output[-4000:]
    assert f"check mode: would install {expected_packages} from http://127.0.0.1:9/cuda/" in run.output
    assert ("fabric manager on (NVSwitch present)" if nvswitch else "fabric manager off (no NVSwitch)") in run.output
    assert "no NVIDIA device" not in run.output
    # --diff shows the repository file and the CDI unit that a GPU node would get.
    assert "+URIs: http://127.0.0.1:9/cuda/" in run.output
    assert "+Signed-By: /etc/apt/keyrings/nvidia-container-toolkit.asc" in run.output
    assert "+ExecStart=/usr/bin/nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml" in run.output
    node = testinfra.get_host(f"podman://{NODE_B}")
    assert not node.file("/etc/apt/sources.list.d/nvidia.sources").exists
    assert not node.file("/etc/systemd/system/pdstack-nvidia-cdi.service").exists


@pytest.fixture
def two_blank_disks(cluster: Cluster) -> Iterator[list[str]]:
    disks = [attach_loop_device(cluster.workdir / f"raid{index}.img") for index in range(2)]
    yield disks
    for disk in disks:
        detach_loop_device(disk)


def test_raid_and_network_mounts_in_check_mode(cluster: Cluster, two_blank_disks: list[str]) -> None:
    run = cluster.playbook(
        "--check",
        "--diff",
        "--limit",
        NODE_A,
        "--tags",
        "storage",
        *extra_vars(
            {
                "storage_nvme_devices": two_blank_disks,
                "storage_mount_point": "/mnt/raid",
                "storage_network_mounts": [
                    {"src": "nfs.pdstack.test:/models", "path": "/mnt/shared", "fstype": "nfs4"}
                ],
            }
        ),
    )
    assert run.returncode == 0, run.output[-4000:]
    create = run.output.split("TASK [storage : Create the RAID0 array when it does not exist]")[1].split("TASK [")[0]
    assert f"changed: [{NODE_A}]" in create
    assert "would create xfs on /dev/md/pdstack" in run.output
    mount = run.output.split("TASK [storage : Mount the shared filesystems and persist them in fstab]")[1]
    assert f"changed: [{NODE_A}] => (item=nfs.pdstack.test:/models -> /mnt/shared)" in mount.split("TASK [")[0]
    node = testinfra.get_host(f"podman://{NODE_A}")
    assert not node.exists("/dev/md/pdstack") and not node.file("/dev/md/pdstack").exists
    fstab = node.file("/etc/fstab").content_string
    assert "/mnt/raid" not in fstab and "/mnt/shared" not in fstab
    for disk in two_blank_disks:
        assert node.run(f"blkid {disk}").rc == 2  # still blank


def test_aws_time_sync_in_check_mode(cluster: Cluster) -> None:
    run = cluster.playbook(
        "--check", "--diff", "--limit", NODE_B, "--tags", "time_sync", *extra_vars({"time_sync_aws": True})
    )
    assert run.returncode == 0, run.output[-4000:]
    assert "+server 169.254.169.123 prefer iburst minpoll 4 maxpoll 4" in run.output
    node = testinfra.get_host(f"podman://{NODE_B}")
    assert "169.254.169.123" not in node.file("/etc/chrony/chrony.conf").content_string


def test_lustre_without_a_client_package_fails_naming_the_mount(cluster: Cluster, tmp_path: Path) -> None:
    run = cluster.playbook(
        "--check",
        "--limit",
        NODE_B,
        "--tags",
        "storage",
        *extra_vars({"storage_network_mounts": [{"src": "10.0.0.5@tcp:/fsx", "path": "/mnt/fsx", "fstype": "lustre"}]}),
    )
    assert run.returncode != 0
    assert "storage_network_mounts: /mnt/fsx asks for lustre, which has no client package on Debian 12" in run.output
