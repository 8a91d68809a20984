"""Paths that need a GPU or several real disks, run in check mode against a converged node.

Check mode proves the decisions (what is installed, created, mounted), the rendered files (--diff) and that nothing
was changed on the node; the NVIDIA package installs, service starts and mdadm/mkfs runs themselves only happen on
real hardware.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import testinfra

from tests.roles.conftest import NODE_A, NODE_B, Cluster, attach_loop_device, detach_loop_device

pytestmark = pytest.mark.timeout(1500)


def extra_vars(values: dict[str, object]) -> tuple[str, str]:
    return "-e", json.dumps(values)


def headers_for(kernel: str) -> str:
    """Debian's headers for the running kernel, and its flavour's metapackage (linux-headers-cloud-amd64 on EC2)."""
    packages = [f"linux-headers-{kernel}"]
    flavour = re.match(r"^\d+\.\d+\.\d+-\d+-([a-z0-9-]+)$", kernel)
    return ", ".join(packages + ([f"linux-headers-{flavour.group(1)}"] if flavour else []))


@pytest.mark.parametrize(
    ("nvswitch", "expected_extra"),
    [(True, "nvidia-fabricmanager, nvidia-container-toolkit"), (False, "nvidia-container-toolkit")],
)
def test_gpu_path_in_check_mode(cluster: Cluster, nvswitch: bool, expected_extra: str) -> None:
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
    node = testinfra.get_host(f"podman://{NODE_B}")
    plan = " ".join(run.output.split("gpu_driver: check mode: would install")[1].split('"')[0].split())
    # Debian 12: the running kernel's headers first (DKMS builds against them), the branch pin before the driver,
    # NVIDIA's compute-only packages, then fabric manager (held to the branch by the pin) and the toolkit.
    assert plan.startswith(
        f"the kernel headers {headers_for(node.check_output('uname -r'))} (DKMS builds the modules against them), "
        "then nvidia-driver-pinning-570 (holds every driver package to branch 570), "
        "then the driver nvidia-driver-cuda, nvidia-kernel-open-dkms, nvidia-persistenced, "
        f"then {expected_extra} from http://127.0.0.1:9/cuda/"
    ), plan
    assert ("fabric manager on (NVSwitch present)" if nvswitch else "fabric manager off (no NVSwitch)") in plan
    assert "no NVIDIA device" not in run.output
    # --diff shows the repository file (with Debian's contrib) and the CDI unit that a GPU node would get.
    assert "+URIs: http://127.0.0.1:9/cuda/" in run.output
    assert "+Signed-By: /etc/apt/keyrings/nvidia-container-toolkit.asc" in run.output
    assert "+Components: contrib" in run.output and "+Suites: bookworm bookworm-updates" in run.output
    assert "+ExecStart=/usr/bin/nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml" in run.output
    # A forced GPU is no real one: nothing is loaded and nobody reboots.
    assert "Reboot into the new NVIDIA driver" not in run.output
    assert not node.file("/etc/apt/sources.list.d/nvidia.sources").exists
    assert not node.file("/etc/systemd/system/pdstack-nvidia-cdi.service").exists


@pytest.mark.parametrize("loaded", ["570.133.20", "550.163.01"])
def test_existing_driver_is_reused_only_on_the_pinned_branch(cluster: Cluster, loaded: str) -> None:
    # The node image's driver, as the kernel reports a loaded nvidia module (/sys/module/nvidia/version).
    node = testinfra.get_host(f"podman://{NODE_B}")
    node.check_output(f"echo {loaded} > /tmp/nvidia-module-version")
    try:
        run = cluster.playbook(
            "--check",
            "--limit",
            NODE_B,
            "--tags",
            "gpu_driver",
            *extra_vars(
                {
                    "gpu_driver_force_gpu_present": True,
                    "gpu_driver_force_nvswitch_present": True,
                    "gpu_driver__module_version_file": "/tmp/nvidia-module-version",
                }
            ),
        )
    finally:
        node.check_output("rm -f /tmp/nvidia-module-version")
    if loaded.startswith("570."):
        assert run.returncode == 0, run.output[-4000:]
        plan = " ".join(run.output.split("gpu_driver: check mode: would install")[1].split('"')[0].split())
        assert plan.startswith(
            "nothing of the driver: the node's NVIDIA driver 570.133.20 is of the pinned branch 570 and is reused; "
            "then nvidia-fabricmanager=570.133.20*, nvidia-container-toolkit from"
        ), plan
        assert "linux-headers" not in plan and "nvidia-driver-pinning" not in plan
    else:
        assert run.returncode != 0
        assert "this node already has NVIDIA driver 550.163.01, not of the pinned branch gpu_driver_branch=570" in (
            " ".join(run.output.split())
        )


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
