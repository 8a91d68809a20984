"""The baseline converges fresh Debian 12 nodes, changes nothing the second time, and leaves what each role promises."""

from __future__ import annotations

import json

import pytest
import testinfra

from pdstack.local.registry import NODE_AUTH_FILE
from tests.roles.conftest import NODE_A, NODE_B, Cluster

pytestmark = pytest.mark.timeout(1500)


def host(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"podman://{name}")


def test_first_run_converges_both_nodes(cluster: Cluster) -> None:
    assert cluster.first_run.returncode == 0, cluster.first_run.output[-4000:]
    for name in (NODE_A, NODE_B):
        recap = cluster.first_run.recap(name)
        assert recap["failed"] == 0 and recap["unreachable"] == 0
        assert recap["changed"] > 10


def test_second_run_changes_nothing(cluster: Cluster) -> None:
    assert cluster.second_run.returncode == 0, cluster.second_run.output[-4000:]
    for name in (NODE_A, NODE_B):
        assert cluster.second_run.recap(name)["changed"] == 0, cluster.second_run.output[-4000:]


def test_check_diff_on_converged_nodes_reports_no_change(cluster: Cluster) -> None:
    run = cluster.playbook("--check", "--diff")
    assert run.returncode == 0, run.output[-4000:]
    for name in (NODE_A, NODE_B):
        assert run.recap(name)["changed"] == 0, run.output[-4000:]


# time_sync ------------------------------------------------------------------------------------------------------


def test_chrony_runs_with_the_configured_sources(cluster: Cluster) -> None:
    node = host(NODE_A)
    assert node.package("chrony").is_installed
    assert node.service("chrony").is_running and node.service("chrony").is_enabled
    conf = node.file("/etc/chrony/chrony.conf").content_string
    assert "server 127.0.0.1 iburst" in conf
    assert "makestep 1.0 3" in conf and "maxdistance 3.0" in conf
    assert "169.254.169.123" not in conf  # AWS time sync only when time_sync_aws is set
    # A container shares its host's clock: chronyd must only measure (-x), never step the host.
    daemons = node.process.filter(comm="chronyd")
    assert daemons and all(" -x" in daemon.args for daemon in daemons)
    assert "127.0.0.1" in node.check_output("chronyc -n sources")


def test_timezone_is_utc(cluster: Cluster) -> None:
    node = host(NODE_B)
    assert node.check_output("readlink -f /etc/localtime").endswith("/UTC")
    assert node.check_output("date +%Z") == "UTC"


# kernel_tuning --------------------------------------------------------------------------------------------------


def test_socket_buffers_are_sized_from_the_link(cluster: Cluster) -> None:
    # 25 Gbit/s x 40 ms = 125,000,000 bytes of BDP; ceiling and default 2 x BDP = 250,000,000 bytes.
    node = host(NODE_A)
    conf = node.file("/etc/sysctl.d/60-pdstack-kernel-tuning.conf").content_string
    assert "net.core.rmem_max = 250000000" in conf
    assert "net.ipv4.tcp_rmem = 4096 250000000 250000000" in conf
    assert "bandwidth-delay product 125000000 bytes" in conf
    # Every value carries its reason in a comment right above it.
    lines = conf.splitlines()
    for index, line in enumerate(lines):
        if " = " in line and not line.startswith("#"):
            assert lines[index - 1].startswith("# "), line


def test_namespaced_sysctls_are_live_on_the_node(cluster: Cluster) -> None:
    node = host(NODE_A)
    assert node.sysctl("net.ipv4.tcp_rmem") == "4096\t250000000\t250000000"
    assert node.sysctl("net.ipv4.tcp_congestion_control") == "bbr"
    assert node.sysctl("net.ipv4.tcp_slow_start_after_idle") == 0
    assert node.sysctl("net.core.somaxconn") == 4096


def test_unowned_sysctls_are_reported_not_applied(cluster: Cluster) -> None:
    output = cluster.first_run.output
    assert "kernel_tuning: not applied live" in output
    assert "fs.file-max" in output and "fs.nr_open" in output


def test_open_file_limits_are_persisted(cluster: Cluster) -> None:
    node = host(NODE_B)
    limits = " ".join(node.file("/etc/security/limits.d/60-pdstack.conf").content_string.split())
    assert "* hard nofile 1048576" in limits
    manager = node.file("/etc/systemd/system.conf.d/60-pdstack-limits.conf").content_string
    assert "DefaultLimitNOFILE=1048576:1048576" in manager


# numa -----------------------------------------------------------------------------------------------------------


def test_numa_balancing_and_hugepages_are_persisted(cluster: Cluster) -> None:
    node = host(NODE_A)
    assert "kernel.numa_balancing = 0" in node.file("/etc/sysctl.d/60-pdstack-numa.conf").content_string
    script = node.file("/usr/local/sbin/pdstack-numa-apply")
    assert script.mode == 0o755
    assert 'governor="performance"' in script.content_string
    assert "set_hugepages 2048 512" in script.content_string
    assert "for nic in eth0; do" in script.content_string
    unit = node.service("pdstack-numa")
    assert unit.is_enabled
    # The unit refuses to touch the host's sysfs from a container.
    assert node.check_output("systemctl show -p ConditionResult --value pdstack-numa") == "no"
    assert "numa: this node is a container" in cluster.first_run.output


def test_topology_fact_describes_numa_nodes_and_nics(cluster: Cluster) -> None:
    node = host(NODE_B)
    topology = json.loads(node.check_output("/etc/ansible/facts.d/pdstack_topology.fact"))
    assert topology["numa_nodes"] and all(entry["cpus"] for entry in topology["numa_nodes"].values())
    assert "eth0" in [nic["name"] for nic in topology["nics"]]
    assert topology["gpus"] == [] and topology["gpu_nic_affinity"] == []


# storage --------------------------------------------------------------------------------------------------------


def test_local_disk_is_formatted_and_mounted_by_uuid(cluster: Cluster) -> None:
    node = host(NODE_A)
    uuid = node.check_output(f"blkid -s UUID -o value {cluster.disk}")
    assert node.check_output(f"blkid -s TYPE -o value {cluster.disk}") == "xfs"
    mount = node.mount_point("/mnt/nvme")
    assert mount.exists and mount.filesystem == "xfs"
    fstab = node.file("/etc/fstab").content_string
    assert f"UUID={uuid} /mnt/nvme xfs defaults,noatime,nofail" in fstab
    cache = node.file("/mnt/nvme/models")
    assert cache.is_directory and cache.mode == 0o755
    # The cache really lives on the disk: a file written there shows in the disk's usage.
    node.check_output("dd if=/dev/zero of=/mnt/nvme/models/probe bs=1M count=8 status=none && sync")
    assert node.check_output("stat -f -c %b /mnt/nvme") != ""


def test_existing_filesystem_is_never_reformatted(cluster: Cluster) -> None:
    node = host(NODE_A)
    node.check_output("echo kept > /mnt/nvme/models/marker")
    run = cluster.playbook("--tags", "storage", "--limit", NODE_A)
    assert run.returncode == 0, run.output[-3000:]
    assert "is never reformatted" in run.output
    assert node.file("/mnt/nvme/models/marker").content_string == "kept\n"


def test_node_without_disk_keeps_cache_on_root(cluster: Cluster) -> None:
    node = host(NODE_B)
    assert node.file("/mnt/nvme/models").is_directory
    assert not node.mount_point("/mnt/nvme").exists
    assert "storage: no instance-store NVMe devices" in cluster.first_run.output


# gpu_driver -----------------------------------------------------------------------------------------------------


def test_gpu_less_node_says_what_it_skipped(cluster: Cluster) -> None:
    assert "gpu_driver: no NVIDIA device on the PCI bus" in cluster.first_run.output
    node = host(NODE_B)
    assert "blacklist nouveau" in node.file("/etc/modprobe.d/blacklist-nouveau.conf").content_string
    assert node.file("/etc/cdi").is_directory
    assert not node.file("/etc/apt/sources.list.d/nvidia.sources").exists
    assert not node.package("nvidia-container-toolkit").is_installed


# container_runtime ----------------------------------------------------------------------------------------------


def test_podman_is_configured(cluster: Cluster) -> None:
    node = host(NODE_A)
    assert node.package("podman").is_installed
    conf = node.file("/etc/containers/containers.conf").content_string
    assert "log_size_max = 52428800" in conf
    assert 'cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]' in conf
    info = json.loads(node.check_output("podman info --format json"))
    assert info["host"]["ociRuntime"]["name"] == "runc"
    assert "registry.pdstack.test:5000" in info["registries"]
    assert info["host"]["cgroupManager"] == "cgroupfs" and info["host"]["eventLogger"] == "file"


def test_registry_mirror_and_credentials(cluster: Cluster) -> None:
    node = host(NODE_B)
    registries = node.file("/etc/containers/registries.conf.d/60-pdstack.conf").content_string
    assert 'location = "registry.pdstack.test:5000"' in registries
    assert 'location = "mirror.pdstack.test:5000"' in registries
    auth = node.file(NODE_AUTH_FILE)
    assert auth.mode == 0o600
    assert "registry.pdstack.test:5000" in json.loads(auth.content_string)["auths"]
    assert "test-only-password" not in cluster.first_run.output  # credentials never reach the log


# node_exporter --------------------------------------------------------------------------------------------------


def test_node_exporter_serves_the_clock_state_on_the_node_address(cluster: Cluster) -> None:
    node = host(NODE_B)
    assert node.service("prometheus-node-exporter").is_running
    assert node.service("prometheus-node-exporter").is_enabled
    address = node.check_output("hostname -I").split()[0]
    metrics = node.check_output(
        f'python3 -c "import urllib.request; print(urllib.request.urlopen('
        f"'http://{address}:9100/metrics', timeout=5).read().decode())\""
    )
    assert "node_timex_offset_seconds" in metrics and "node_timex_sync_status" in metrics
