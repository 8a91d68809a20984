"""The node library picks the host's reachable Debian mirror for debootstrap and the node image."""

from __future__ import annotations

from pathlib import Path

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
