"""A node container boots from a NoCloud seed as an instance boots from its launch template: cloud-init runs the user
data once per instance (its files, their modes, its commands), the vendor data's credentials reach root's AWS files at
every boot and the operators' key root's authorized_keys, the node knows its instance id as stage 0 asks for it, and
the pools' real user data passes cloud-init's schema. One node for the module, booted and then restarted once; a node
without a seed leaves cloud-init disabled."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.local import cloud_seed, nodes
from pdstack.node import loader
from pdstack.node.userdata import render_user_data
from pdstack.stacks.environment import load_environment
from tests.support import STACKS

NODE = "seedtest-node"
HOSTNAME = "seedtest-host"
ACCESS_KEY_ID = "ASIASEEDTEST00000001"
SECRET_ACCESS_KEY = "seedtest/secret+access/key0000000000000000"
SESSION_TOKEN = "seedtest-session-token//with+odd'chars\"and$dollars"
REGION = "us-east-1"
OPERATOR_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDuV6AK0SeedTestKey0000000000000000000000000 pdstack-nodes\n"
LOCALE_FALSE = "locale: False is not of type 'string'"
USER_DATA = """\
#cloud-config
locale: false
write_files:
  - path: /etc/seedtest/node.json
    permissions: '0644'
    content: |
      {"pool": "decode"}
  - path: /usr/local/lib/seedtest/stage0.sh
    permissions: '0750'
    content: |
      #!/bin/sh
      echo stage0
runcmd:
  - echo "runcmd $(cat /etc/seedtest/node.json)" >> /var/lib/seedtest-runcmd.log
"""
# the real user data's pools: the local ones (a local node boots them) and the cloud's (the launch template's)
POOLS = (
    ("local", "local-dc1", "prefill"),
    ("local", "local-dc2", "decode"),
    ("prod", "prod-decode-us-west-2", "decode-h200"),
)


@dataclass(frozen=True)
class Booted:
    name: str
    seed: cloud_seed.InstanceSeed
    first_runcmd_log: str  # after the first boot


def sh(name: str, script: str) -> str:
    return nodes.exec_in_node(name, ["sh", "-c", script])


@pytest.fixture(scope="module")
def node_image() -> str:
    return nodes.build_node_image()


@pytest.fixture(scope="module")
def booted(node_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Booted]:
    seed = cloud_seed.InstanceSeed(
        instance_id=cloud_seed.new_instance_id(),
        hostname=HOSTNAME,
        user_data=USER_DATA,
        vendor_data=cloud_seed.platform_vendor_data(
            ACCESS_KEY_ID, SECRET_ACCESS_KEY, SESSION_TOKEN, REGION, OPERATOR_KEY
        ),
    )
    folder = cloud_seed.write_seed(seed, tmp_path_factory.mktemp("seed") / "nocloud")
    try:
        cloud_seed.launch_instance(nodes.NodeSpec(NODE, image=node_image, extra_args=("--network", "none")), folder)
        cloud_seed.wait_for_cloud_init(NODE, timeout=120)
        first = sh(NODE, "cat /var/lib/seedtest-runcmd.log")
        subprocess.run(["podman", "restart", "-t", "5", NODE], check=True, capture_output=True)
        cloud_seed.wait_for_cloud_init(NODE, timeout=120)
        yield Booted(NODE, seed, first)
    finally:
        nodes.remove_node(NODE)


def test_the_seed_folder_holds_the_three_files(tmp_path: Path) -> None:
    seed = cloud_seed.InstanceSeed("i-0123456789abcdef0", "node-a", "#cloud-config\n{}\n", None)
    folder = cloud_seed.write_seed(seed, tmp_path / "seed")
    assert sorted(p.name for p in folder.iterdir()) == ["meta-data", "user-data", "vendor-data"]
    assert yaml.safe_load((folder / "meta-data").read_text()) == {
        "instance-id": "i-0123456789abcdef0",
        "local-hostname": "node-a",
    }
    assert (folder / "user-data").read_text() == seed.user_data
    assert (folder / "vendor-data").read_text() == "#cloud-config\n"
    assert {(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {0o600}
    assert folder.stat().st_mode & 0o777 == 0o700


def test_instance_ids_look_like_ec2s() -> None:
    ids = {cloud_seed.new_instance_id() for _ in range(50)}
    assert len(ids) == 50
    for value in ids:
        assert value.startswith("i-") and len(value) == 19
        assert all(c in "0123456789abcdef" for c in value[2:])


def test_launching_without_a_seed_is_refused(tmp_path: Path) -> None:
    with pytest.raises(nodes.NodeError, match="has no user-data or meta-data"):
        cloud_seed.launch_instance(nodes.NodeSpec("seedtest-unused"), tmp_path)


def real_user_data(environment: str, stack: str, pool: str) -> str:
    env = load_environment(STACKS, environment)
    endpoint = "http://10.210.0.1:5000" if environment == "local" else None
    return render_user_data(env.stack(stack).config, env.control.config, pool, endpoint)


@pytest.mark.parametrize(("environment", "stack", "pool"), POOLS)
def test_the_real_user_data_leaves_vendor_datas_keys_alone(environment: str, stack: str, pool: str) -> None:
    document: dict[str, Any] = yaml.safe_load(real_user_data(environment, stack, pool))
    assert set(cloud_seed.VENDOR_DATA_KEYS).isdisjoint(document)
    vendor = yaml.safe_load(cloud_seed.platform_vendor_data("a", "b", None, REGION))
    assert set(vendor) == set(cloud_seed.VENDOR_DATA_KEYS)


def test_user_data_files_are_written_with_their_modes(booted: Booted) -> None:
    listing = sh(booted.name, "stat -c '%a %U %n' /etc/seedtest/node.json /usr/local/lib/seedtest/stage0.sh")
    assert listing.split("\n")[:2] == ["644 root /etc/seedtest/node.json", "750 root /usr/local/lib/seedtest/stage0.sh"]
    assert sh(booted.name, "cat /etc/seedtest/node.json") == '{"pool": "decode"}\n'
    assert sh(booted.name, "/usr/local/lib/seedtest/stage0.sh") == "stage0\n"


def test_runcmd_ran_once_for_two_boots(booted: Booted) -> None:
    assert booted.first_runcmd_log == 'runcmd {"pool": "decode"}\n'
    assert sh(booted.name, "cat /var/lib/seedtest-runcmd.log") == booted.first_runcmd_log
    finished = sh(booted.name, f"grep -c '^Cloud-init v. .* finished at' {cloud_seed.OUTPUT_LOG}")
    assert finished.strip() == "2"  # cloud-init did run at the second boot


def test_vendor_data_writes_the_credentials(booted: Booted) -> None:
    assert sh(booted.name, f"stat -c '%a' {cloud_seed.AWS_CREDENTIALS} {cloud_seed.AWS_CONFIG}").split() == [
        "600",
        "600",
    ]
    assert sh(booted.name, f"cat {cloud_seed.AWS_CREDENTIALS}") == (
        f"[default]\naws_access_key_id = {ACCESS_KEY_ID}\naws_secret_access_key = {SECRET_ACCESS_KEY}\n"
        f"aws_session_token = {SESSION_TOKEN}\n"
    )
    assert sh(booted.name, f"cat {cloud_seed.AWS_CONFIG}") == f"[default]\nregion = {REGION}\n"


def test_vendor_data_lets_the_operators_key_in(booted: Booted) -> None:
    keys = cloud_seed.AUTHORIZED_KEYS
    assert sh(booted.name, f"stat -c '%a %U' {keys.parent} {keys}").split("\n")[:2] == ["700 root", "600 root"]
    assert sh(booted.name, f"cat {keys}") == OPERATOR_KEY


def test_the_secret_is_in_no_readable_log(booted: Booted) -> None:
    readable = sh(
        booted.name,
        "find /var/log /run/cloud-init -type f -perm -o=r -print0 | xargs -0 grep -l "
        f"-e {SECRET_ACCESS_KEY} -e seedtest-session-token || true",
    )
    assert readable == ""


def test_the_node_knows_its_instance_id_as_stage_0_asks(booted: Booted) -> None:
    def in_node(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["podman", "exec", booted.name, *argv], **kwargs)  # noqa: PLW1510 (the loader says check)

    assert loader.instance_id(run=in_node) == booted.seed.instance_id
    assert sh(booted.name, "hostname").strip() == HOSTNAME
    assert cloud_seed.cloud_init_status(booted.name) == "done"


def schema_errors(name: str, path: str) -> set[str]:
    """What `cloud-init schema` finds wrong with the file at `path` in the node (none: it says it is valid)."""
    checked = subprocess.run(
        ["podman", "exec", name, "cloud-init", "schema", "--config-file", path],
        capture_output=True,
        text=True,
        check=False,
    )
    if checked.returncode == 0:
        assert f"Valid cloud-config: {path}" in checked.stdout
        return set()
    [line] = [line for line in checked.stderr.splitlines() if line.startswith("Cloud config schema errors: ")]
    return set(line.removeprefix("Cloud config schema errors: ").split(", "))


def test_cloud_init_accepts_the_real_user_data(booted: Booted) -> None:
    """Debian 12's cloud-init (22.4) types `locale` as a string in its schema, while its locale module takes false
    as "leave the locale alone" (what the user data means: a container has no locales to generate); the runtime
    accepts it (this module's node boots user data that says it, with no error), so that is the one error allowed."""
    for environment, stack, pool in POOLS:
        path = f"/tmp/user-data-{stack}-{pool}"
        subprocess.run(
            ["podman", "exec", "-i", booted.name, "sh", "-c", f"cat > {path}"],
            input=real_user_data(environment, stack, pool),
            text=True,
            check=True,
        )
        assert schema_errors(booted.name, path) <= {LOCALE_FALSE}, stack
    status = json.loads(sh(booted.name, "cloud-init status --format json"))
    assert (status["status"], status["errors"]) == ("done", [])


def test_a_node_without_a_seed_leaves_cloud_init_disabled(node_image: str) -> None:
    name = "seedtest-noseed"
    try:
        nodes.create_node(nodes.NodeSpec(name, image=node_image, extra_args=("--network", "none")))
        assert cloud_seed.cloud_init_status(name) == "disabled"
        assert sh(name, "test -e /root/.aws || echo none") == "none\n"
        assert sh(name, "id debian 2>/dev/null || echo none") == "none\n"  # no module ran: not even the users'
        with pytest.raises(nodes.NodeError, match="cloud-init in node seedtest-noseed: disabled"):
            cloud_seed.wait_for_cloud_init(name, timeout=10)
    finally:
        nodes.remove_node(name)


def test_a_failing_user_data_is_reported_with_its_output(node_image: str, tmp_path: Path) -> None:
    name = "seedtest-failing"
    seed = cloud_seed.InstanceSeed(
        cloud_seed.new_instance_id(), name, "#cloud-config\nruncmd:\n  - echo seedtest-broken >&2; exit 3\n"
    )
    try:
        cloud_seed.launch_instance(
            nodes.NodeSpec(name, image=node_image, extra_args=("--network", "none")),
            cloud_seed.write_seed(seed, tmp_path),
        )
        with pytest.raises(nodes.NodeError) as failed:
            cloud_seed.wait_for_cloud_init(name, timeout=120)
        message = str(failed.value)
        assert "cloud-init in node seedtest-failing: error" in message
        assert "status: error" in message
        assert "seedtest-broken" in message  # the output log's tail
    finally:
        nodes.remove_node(name)
