"""The node library picks the host's reachable Debian mirror for debootstrap and the node image, and tells a node
that runs from one podman only remembers running."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pdstack.local import nodes


def test_mirror_from_deb822_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example.test/debian/\nSuites: bookworm\nComponents: main\n"
    )
    (tmp_path / "sources.list.d" / "other.list").write_text("deb https://apt.example.test/node nodistro main\n")
    assert nodes.host_mirror(tmp_path) == "http://mirror.example.test/debian"


def test_mirror_from_one_line_sources_list(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("# comment\ndeb http://ftp.example.test/debian bookworm main\n")
    assert nodes.host_mirror(tmp_path) == "http://ftp.example.test/debian"


def test_default_mirror_when_nothing_is_configured(tmp_path: Path) -> None:
    assert nodes.host_mirror(tmp_path) == nodes.DEFAULT_MIRROR


def test_node_volume_is_named_after_the_node() -> None:
    assert nodes.NodeSpec("dc1-node-0").volume == "dc1-node-0-containers"


def inspect(name: str, template: str) -> str:
    return subprocess.run(
        ["podman", "inspect", "--format", template, name], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.mark.slow
def test_a_node_killed_behind_podmans_back_is_not_running_and_is_replaced() -> None:
    """As after a session whose processes all ended: podman still says "running" (its conmon died with the node),
    every exec fails; `up` must see it as stopped and start a new node in its place."""
    name = "nodestest-stale"
    spec = nodes.NodeSpec(name, image=nodes.build_node_image(), extra_args=("--network", "none"))
    try:
        nodes.create_node(spec)
        assert nodes.node_running(name)
        for pid in inspect(name, "{{.State.ConmonPid}} {{.State.Pid}}").split():
            os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while nodes.node_running(name):  # a kill is sent, not waited for: the node's init exits moments later
            assert time.monotonic() < deadline, "the node's init still runs 30 s after SIGKILL"
            time.sleep(0.2)
        assert inspect(name, "{{.State.Running}}") == "true"  # podman's record: what misled `up` before
        assert nodes.stopped_reason(name) is not None
        nodes.create_node(spec)  # removes the stale one first
        assert nodes.node_running(name)
        assert nodes.exec_in_node(name, ["echo", "alive"]) == "alive\n"
    finally:
        nodes.remove_node(name)
