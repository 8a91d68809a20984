"""kernel_tuning's computed values without a node container: the sysctl file and the peer route script rendered on
this machine by the role's own sizing tasks, and the script run in a throwaway network namespace."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import REPO
from tests.support.ansible import ANSIBLE_PLAYBOOK

ROLE = REPO / "roles" / "kernel_tuning"


def render(tmp_path: Path, variables: dict[str, object]) -> tuple[str, Path]:
    """The sysctl file's text and the route script's path, as the role renders them for `variables`."""
    playbook = tmp_path / "render.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "ansible.builtin.include_role": {
                                "name": "kernel_tuning",
                                "tasks_from": "size.yml",
                                "public": True,
                            }
                        },
                        {
                            "ansible.builtin.template": {
                                "src": str(ROLE / "templates" / "sysctl.conf.j2"),
                                "dest": str(tmp_path / "sysctl.conf"),
                                "mode": "0644",
                            }
                        },
                        {
                            "ansible.builtin.template": {
                                "src": str(ROLE / "templates" / "pdstack-kv-routes.sh.j2"),
                                "dest": str(tmp_path / "routes.sh"),
                                "mode": "0755",
                            }
                        },
                    ],
                }
            ]
        )
    )
    result = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", "localhost,", str(playbook), "-e", json.dumps(variables)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={
            "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
            "HOME": str(tmp_path),
        },
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return (tmp_path / "sysctl.conf").read_text(), tmp_path / "routes.sh"


WAN = {"kernel_tuning_link_bandwidth_gbps": 1.0, "kernel_tuning_link_rtt_ms": 20.0, "kernel_tuning_link_mtu": 1500}
PEERS = [
    {"cidr": "10.251.0.0/16", "bandwidth_gbps": 1.0, "rtt_ms": 20.0},  # 2,500,000 / 1448: 1727 segments
    {"cidr": "10.252.0.0/16", "bandwidth_gbps": 25.0, "rtt_ms": 62.0},  # 193,750,000 / 1448: 133806
    {"cidr": "10.253.0.0/16", "bandwidth_gbps": 0.01, "rtt_ms": 1.0},  # 1,250 bytes: the kernel's own 10
]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return render(tmp_path_factory.mktemp("kernel_tuning"), {**WAN, "kernel_tuning_peer_links": PEERS})


def test_buffer_defaults_are_twice_the_bdp_and_slow_start_after_idle_is_off(rendered: tuple[str, Path]) -> None:
    # 1 Gbit/s x 20 ms = 2,500,000 bytes of BDP: a new connection's buffers start at 2 x BDP (the ceiling stays at
    # its 16 MiB floor).
    conf, _script = rendered
    assert "net.ipv4.tcp_rmem = 4096 5000000 16777216" in conf
    assert "net.ipv4.tcp_wmem = 4096 5000000 16777216" in conf
    assert "net.ipv4.tcp_slow_start_after_idle = 0" in conf


def test_a_short_link_keeps_the_kernels_default_at_least(tmp_path: Path) -> None:
    conf, _script = render(tmp_path, {"kernel_tuning_link_bandwidth_gbps": 0.1, "kernel_tuning_link_rtt_ms": 0.5})
    assert "net.ipv4.tcp_rmem = 4096 131072 16777216" in conf  # 2 x 6,250 bytes of BDP is below the kernel's 128 KiB


def test_peer_routes_start_with_one_bdp_in_full_segments(rendered: tuple[str, Path]) -> None:
    routes = [line for line in rendered[1].read_text().splitlines() if line.startswith("route ")]
    assert routes == [
        "route 10.251.0.0/16 10.251.0.0 1727",
        "route 10.252.0.0/16 10.252.0.0 133806",
        "route 10.253.0.0/16 10.253.0.0 10",
    ]


def ip(namespace: str, *argv: str) -> str:
    return subprocess.run(["ip", "-n", namespace, *argv], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace")
def test_the_route_script_keeps_the_next_hop_and_sets_the_window(rendered: tuple[str, Path]) -> None:
    """In a namespace whose route to a peer subnet goes via a gateway: the script replaces it with the same next hop
    and device plus initcwnd/initrwnd of one BDP, and a second run changes nothing."""
    namespace = f"pdstack-kt-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        ip(namespace, "link", "add", "kt0", "type", "veth", "peer", "name", "kt1")
        ip(namespace, "addr", "add", "10.250.0.2/24", "dev", "kt0")
        for device in ("kt0", "kt1"):
            ip(namespace, "link", "set", device, "up")
        for peer in PEERS:
            ip(namespace, "route", "add", peer["cidr"], "via", "10.250.0.1", "dev", "kt0")
        run = ["ip", "netns", "exec", namespace, "/bin/sh", str(rendered[1])]
        first = subprocess.run(run, capture_output=True, text=True, check=True).stdout
        route = ip(namespace, "-o", "route", "show", "exact", "10.251.0.0/16")
        second = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    finally:
        subprocess.run(["ip", "netns", "delete", namespace], check=False)
    assert first.splitlines() == [f"changed {peer['cidr']}" for peer in PEERS]
    assert "via 10.250.0.1 dev kt0" in route and "initcwnd 1727" in route and "initrwnd 1727" in route, route
    assert second == ""


@pytest.mark.parametrize(
    ("inventory", "group", "peer", "segments"),
    [
        # 1 Gbit/s x 20 ms = 2,500,000 bytes over the local WAN's 65000-byte MTU: 39 segments of 64948
        ("local", "dc_dc1", "10.210.2.0/24", 39),
        # prod's 50 Gbit/s x 62 ms Transit Gateway link in 8448-byte segments: 387,500,000 / 8448 = 45868.8
        ("aws", "prefill-us-east-1", "10.32.0.0/16", 45869),
    ],
)
def test_the_inventories_peer_links_give_each_peer_route_one_bdp(
    tmp_path: Path, inventory: str, group: str, peer: str, segments: int
) -> None:
    """The links the inventories render from the stacks (pdstack.local.inventory, pdstack.contract.cloud_inventory) are
    what the route script takes: each peer datacenter's subnet gets its own link's BDP in its own path MTU's
    segments."""
    if inventory == "local":
        hosts = yaml.safe_load((REPO / "inventories" / "local" / "hosts.yml").read_text())
        variables = hosts["all"]["children"]["nodes"]["children"][group]["vars"]
    else:
        stacks = yaml.safe_load((REPO / "inventories" / "aws" / "group_vars" / "all" / "stacks.yml").read_text())
        entry = stacks["pdstack_cloud"]["prod"]["datacenters"][group]
        variables = {
            "kernel_tuning_link_bandwidth_gbps": entry["link_bandwidth_gbps"],
            "kernel_tuning_link_rtt_ms": entry["link_rtt_ms"],
            "kernel_tuning_peer_links": entry["peer_links"],
        }
    _conf, script = render(tmp_path, variables)
    line = next(line for line in script.read_text().splitlines() if line.startswith(f"route {peer} "))
    assert line.split()[-1] == str(segments), line
