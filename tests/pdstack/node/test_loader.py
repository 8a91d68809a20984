"""Stage 0 (pdstack/node/loader.py): what it may import (it runs before pdstack is on the node), the names it
shares with the contract and the roles, the bundle it checks before unpacking, and its own failure report."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.contract.components import NODE_EXPORTER_TEXTFILE_DIR, REGISTRY_AUTH_FILE
from pdstack.node import loader
from pdstack.node.loader import BootstrapError, Phase, fetch_bundle, install_venv, metrics_text, read_metrics
from tests.pdstack.node.conftest import BUNDLE, Node
from tests.support import REPO
from tests.support.motoserver import CREDENTIALS


def test_stage_0_imports_only_the_standard_library_and_boto3() -> None:
    tree = ast.parse(Path(loader.__file__).read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules - set(sys.stdlib_module_names) - {"__future__"} == {"boto3"}


def test_its_names_are_the_contracts_and_the_roles() -> None:
    assert str(loader.TEXTFILE_DIR) == NODE_EXPORTER_TEXTFILE_DIR
    defaults = yaml.safe_load((REPO / "roles/container_runtime/defaults/main.yml").read_text())
    assert defaults["container_runtime_auth_file"] == REGISTRY_AUTH_FILE
    # Debian's node exporter reads text files from there unless told otherwise (roles/node_exporter does not)
    answer = subprocess.run(["prometheus-node-exporter", "--help"], capture_output=True, text=True, check=False)
    help_text = answer.stdout + answer.stderr
    match = re.search(r'--collector\.textfile\.directory="([^"]+)"', help_text)
    assert match is not None and match[1] == NODE_EXPORTER_TEXTFILE_DIR
    template = (REPO / "roles/node_exporter/templates/prometheus-node-exporter.j2").read_text()
    assert "textfile.directory" not in template


def test_the_metrics_are_prometheus_text() -> None:
    failed = metrics_text({"identity": 0.01, "release": 0.2}, failed="release")
    assert 'pdstack_node_bootstrap_failed{phase="release"} 1\n' in failed
    assert 'pdstack_node_bootstrap_phase_seconds{phase="release"} 0.200\n' in failed
    done = metrics_text({"identity": 0.01}, release="r1", model_bytes=12, now=1000.0)
    assert "pdstack_node_bootstrap_success_timestamp_seconds 1000.000\n" in done
    promtool = subprocess.run(["promtool", "check", "metrics"], input=done, capture_output=True, text=True, check=False)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr


def test_the_metrics_read_back_as_written() -> None:
    """pdstack local scale reads a node's report through read_metrics."""
    parts = {"image": 15.0, "roles": 64.7, "engine_start": 6.75}
    text = metrics_text(
        {"identity": 0.4, "apply": 86.45}, release="r1", model_bytes=716737, apply_parts=parts, now=1000.0
    )
    assert read_metrics(text) == {
        "phase_seconds": {"identity": 0.4, "apply": 86.45},
        "failed": {"": 0.0},
        "success_timestamp_seconds": {"": 1000.0},
        "release_info": {"r1": 1.0},
        "model_downloaded_bytes": {"": 716737.0},
        "apply_seconds": parts,
    }


def tarball(members: dict[str, tarfile.TarInfo | bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, member in members.items():
            if isinstance(member, bytes):
                info = tarfile.TarInfo(name)
                info.size = len(member)
                tar.addfile(info, io.BytesIO(member))
            else:
                tar.addfile(member)
    return out.getvalue()


def test_a_bundle_is_unpacked_once(node: Node, tmp_path: Path) -> None:
    s3 = node.client("s3")
    sha = node.record.bundle.sha256
    first = fetch_bundle(s3, node.bucket, node.record.bundle.key, sha, tmp_path)
    assert first == tmp_path / "bundles" / sha
    assert (first / "playbooks" / "node.yml").is_file()
    s3.delete_object(Bucket=node.bucket, Key=node.record.bundle.key)
    assert fetch_bundle(s3, node.bucket, node.record.bundle.key, sha, tmp_path) == first


def link(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
    return info


@pytest.mark.parametrize(
    "members",
    [{"../escape": b"x"}, {"/etc/cron.d/x": b"x"}, {"roles/link": link("roles/link")}],
    ids=["dotdot", "absolute", "symlink"],
)
def test_a_bundle_that_reaches_outside_is_refused(node: Node, tmp_path: Path, members: dict[str, Any]) -> None:
    data = tarball({"playbooks/node.yml": b"[]\n", **members})
    node.client("s3").put_object(Bucket=node.bucket, Key="bundles/evil.tar.gz", Body=data)
    sha = hashlib.sha256(data).hexdigest()
    with pytest.raises(BootstrapError, match="not a plain file or folder") as caught:
        fetch_bundle(node.client("s3"), node.bucket, "bundles/evil.tar.gz", sha, tmp_path)
    assert caught.value.phase is Phase.BUNDLE
    assert list((tmp_path / "bundles").iterdir()) == []
    assert not (tmp_path.parent / "escape").exists()


def test_the_venv_is_installed_once_offline(tmp_path: Path) -> None:
    bundle = tmp_path / "bundles" / hashlib.sha256(BUNDLE).hexdigest()
    bundle.mkdir(parents=True)
    calls: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        if argv[1:3] == ["-m", "venv"]:
            Path(argv[-1], "bin").mkdir(parents=True)
        return subprocess.CompletedProcess(argv, 0, "", "")

    python = install_venv(bundle, tmp_path, run)
    assert python == tmp_path / "venvs" / bundle.name / "bin" / "python"
    assert calls[0][1:] == ["-m", "venv", "--clear", "--system-site-packages", str(python.parent.parent)]
    assert calls[1] == [
        str(python),
        "-m",
        "pip",
        "install",
        "--no-compile",
        "--no-index",
        "--find-links",
        str(bundle / "wheels"),
        "-r",
        str(bundle / "wheels" / "requirements.txt"),
    ]
    assert (tmp_path / "venv").resolve() == python.parent.parent  # what runs pdstack on the node after the bootstrap
    install_venv(bundle, tmp_path, run)
    assert len(calls) == 2
    assert (tmp_path / "venv").resolve() == python.parent.parent


def test_stage_0_reports_an_absent_release_as_the_bootstrap_does(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": "testing",
    }.items():
        monkeypatch.setenv(name, value)
    node.client("ssm", node.config.control_region).delete_parameter(Name=node.config.release_parameter)
    config = tmp_path / "node.json"
    config.write_text(node.config.to_json())

    code = loader.main(
        config, state_dir=tmp_path / "state", textfile_dir=node.paths.textfile_dir, identify=lambda: node.instance_id
    )

    assert code == 1
    assert 'pdstack_node_bootstrap_failed{phase="release"} 1' in node.metrics()
    assert node.health() == "Unhealthy"
    assert json.loads(config.read_text())["release_parameter"] == node.config.release_parameter


# -- the SSM agent (the operators' way in) ------------------------------------------------------------------------
DEB = b"!<arch>\nnot really a deb"
PIN = {"version": "3.3.1802.0", "sha256": hashlib.sha256(DEB).hexdigest()}


class FakeHost:
    """dpkg-query, dpkg and systemctl as run() sees them, and AWS's S3 distribution as download() does."""

    def __init__(self, installed: str | None = None, body: bytes = DEB) -> None:
        self.installed, self.body = installed, body
        self.calls: list[list[str]] = []
        self.urls: list[str] = []

    def run(self, argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        if argv[0] == "dpkg-query":
            if self.installed is None:
                return subprocess.CompletedProcess(argv, 1, "", "no packages found matching amazon-ssm-agent")
            return subprocess.CompletedProcess(argv, 0, self.installed, "")
        return subprocess.CompletedProcess(argv, 0, "", "")

    def download(self, url: str, target: Path) -> None:
        self.urls.append(url)
        target.write_bytes(self.body)


def test_a_cloud_node_installs_the_pinned_ssm_agent_from_its_regions_distribution(tmp_path: Path) -> None:
    host = FakeHost()
    assert loader.install_ssm_agent(PIN, "us-west-2", tmp_path, run=host.run, download=host.download)
    assert host.urls == [
        "https://s3.us-west-2.amazonaws.com/amazon-ssm-us-west-2/3.3.1802.0/debian_amd64/amazon-ssm-agent.deb"
    ]
    assert [c[:2] for c in host.calls[1:]] == [["dpkg", "--install"], ["systemctl", "enable"]]
    assert host.calls[-1][-2:] == ["--now", "amazon-ssm-agent"]
    assert list(tmp_path.iterdir()) == []  # the .deb does not stay


def test_a_second_boot_finds_the_agent_installed(tmp_path: Path) -> None:
    host = FakeHost(installed="3.3.1802.0-1")
    assert not loader.install_ssm_agent(PIN, "us-west-2", tmp_path, run=host.run, download=host.download)
    assert host.urls == []
    assert len(host.calls) == 1


def test_an_agent_whose_sha256_is_not_the_pins_is_never_installed(tmp_path: Path) -> None:
    host = FakeHost(installed="3.2.0.0-1", body=b"something else")
    with pytest.raises(
        BootstrapError, match=r"phase access: .*amazon-ssm-agent.deb has sha256 .*ssm_agent_sha256"
    ) as e:
        loader.install_ssm_agent(PIN, "us-west-2", tmp_path, run=host.run, download=host.download)
    assert e.value.phase is Phase.ACCESS
    assert not any(c[0] == "dpkg" for c in host.calls)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_download_or_dpkg_fails_the_phase(tmp_path: Path) -> None:
    def unreachable(url: str, target: Path) -> None:
        raise OSError("connection timed out")

    with pytest.raises(BootstrapError, match=r"phase access: cannot download https://s3.us-west-2"):
        loader.install_ssm_agent(PIN, "us-west-2", tmp_path, run=FakeHost().run, download=unreachable)

    def dpkg_fails(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        code = 1 if argv[0] in ("dpkg-query", "dpkg") else 0
        return subprocess.CompletedProcess(argv, code, "", "dpkg: error processing archive")

    with pytest.raises(BootstrapError, match=r"phase access: dpkg --install .* failed: dpkg: error"):
        loader.install_ssm_agent(PIN, "us-west-2", tmp_path, run=dpkg_fails, download=FakeHost().download)


@pytest.mark.parametrize("pin", [{"version": "latest", "sha256": PIN["sha256"]}, {"version": "3.3.1802.0"}])
def test_a_malformed_pin_fails_the_phase(tmp_path: Path, pin: dict[str, str]) -> None:
    with pytest.raises(BootstrapError, match=r"phase access: .*not a version and a sha256"):
        loader.install_ssm_agent(pin, "us-west-2", tmp_path, run=FakeHost().run, download=FakeHost().download)


def test_only_a_cloud_node_installs_the_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = FakeHost()
    cloud = {"aws_region": "us-west-2", "aws_endpoint_url": None, "ssm_agent": PIN}
    local = cloud | {"aws_endpoint_url": "http://10.210.0.1:5000"}
    loader.operators_access(local, tmp_path, run=host.run, download=host.download)
    assert host.calls == []
    loader.operators_access(cloud | {"ssm_agent": None}, tmp_path, run=host.run, download=host.download)
    assert host.calls == []
    assert "pins no SSM agent" in capsys.readouterr().err
    loader.operators_access(cloud, tmp_path, run=host.run, download=host.download)
    assert host.urls and host.calls[-1][0] == "systemctl"
