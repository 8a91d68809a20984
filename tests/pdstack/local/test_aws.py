"""The local environment's AWS (moto in server mode, pdstack.local.aws) and its registry's login
(pdstack.local.registry): what `up` seeds is what a self-joining node's own code reads back.

Real processes on 127.0.0.1: one moto server and one docker-registry with auth, shared by the module; podman pulls
into a throwaway store under tmp (vfs), so the host's images are left alone but for one tiny tag this module adds and
removes.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import httpx
import pytest
import yaml
from cryptography import x509

from pdserve.scheduler.join import _ASSUMED_ROLE
from pdserve.scheduler.settings import SchedulerSettings
from pdstack.contract.components import contract, scheduler_url_parameter, secret_name, tls_secret_name
from pdstack.contract.node_lifecycle import node_group_name, node_role_arn, node_role_name
from pdstack.local.aws import (
    ACCOUNT,
    LocalAws,
    ensure_buckets,
    ensure_groups,
    ensure_node_roles,
    local_secret_values,
    node_credentials,
    pool_tls_values,
    publish_local_release,
    seed_local_aws,
    seed_scheduler_url,
    seed_secrets,
)
from pdstack.local.registry import NODE_AUTH_FILE, Registry, registry_auth_vars
from pdstack.local.secrets import LocalSecrets
from pdstack.local.tls import LocalCA
from pdstack.local.topology import load_topology
from pdstack.local.transport import local_ca
from pdstack.model import Environment
from pdstack.node.join import scheduler_url
from pdstack.node.loader import mark_unhealthy
from pdstack.node.publish import gpu_datacenters
from pdstack.node.registry import registry_auths
from pdstack.node.release import read_release
from pdstack.node.secrets import fetch_secrets
from pdstack.node.userdata import node_config
from pdstack.stacks.environment import EnvironmentStacks, load_environment
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
ENV = "local"
INSTANCE = "i-0123456789abcdef0"
POOL = ("dc1", "prefill")
POOL_ADDRESSES = ["10.210.1.10", "10.210.1.100"]
TINY_IMAGE = "localhost/pdstack-test-aws-tiny:35"


@pytest.fixture(scope="module")
def aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAws]:
    local = LocalAws(tmp_path_factory.mktemp("aws"), "127.0.0.1", free_port())
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def stacks() -> EnvironmentStacks:
    return load_environment(ROOT / "stacks", Environment.LOCAL)


@pytest.fixture(scope="module")
def registry(aws: LocalAws, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    served = Registry(tmp_path_factory.mktemp("registry"), "127.0.0.1", free_port(), aws.registry_credentials())
    served.start()
    try:
        yield served
    finally:
        served.stop()


def as_node(aws: LocalAws, service: str, credentials: dict[str, str]) -> Any:
    """A client on an instance's role credentials, as the node makes it (only the endpoint is the local AWS's)."""
    return boto3.client(service, region_name="us-east-1", endpoint_url=aws.endpoint, **credentials)


def seeded_values(tmp: Path) -> tuple[LocalSecrets, LocalCA, dict[str, str]]:
    secrets = LocalSecrets(tmp / "secrets")
    secrets.ensure()
    ca = LocalCA(tmp / "tls")
    serving = load_environment(ROOT / "stacks", Environment.LOCAL).control.config.serving
    assert serving is not None
    values = local_secret_values(secrets, contract(serving).node_secrets())
    return secrets, ca, values | pool_tls_values(ca, {POOL: POOL_ADDRESSES})


def test_a_node_roles_credentials_are_its_instances_session(aws: LocalAws) -> None:
    arns = ensure_node_roles(aws.client("iam"), ENV, [POOL, ("dc2", "decode")])
    assert ensure_node_roles(aws.client("iam"), ENV, [POOL]) == {POOL: arns[POOL]}  # again: nothing to make
    assert arns[POOL] == node_role_arn(ACCOUNT, ENV, *POOL)

    credentials = node_credentials(aws.client("sts"), arns[POOL], INSTANCE)
    caller = as_node(aws, "sts", credentials).get_caller_identity()

    arn = f"arn:aws:sts::{ACCOUNT}:assumed-role/{node_role_name(ENV, *POOL)}/{INSTANCE}"
    assert caller["Arn"] == arn
    found = _ASSUMED_ROLE.fullmatch(caller["Arn"])  # what the scheduler's join checks of STS's answer
    assert found is not None and found.group(3) == node_role_name(ENV, *POOL) and found.group(4) == INSTANCE


def test_seeded_secrets_are_what_a_node_fetches(aws: LocalAws, stacks: EnvironmentStacks, tmp_path: Path) -> None:
    secrets, ca, values = seeded_values(tmp_path)
    sm = aws.client("secretsmanager")
    written = seed_secrets(sm, ENV, values)
    assert tls_secret_name(ENV, *POOL) in written and secret_name(ENV, "server-api-token") in written
    assert seed_secrets(sm, ENV, values) == []  # a second `up`: nothing changes

    stack = next(s.config for s in stacks.stacks if s.config.datacenter.name == POOL[0])
    config = node_config(stack, stacks.control.config, POOL[1], aws.endpoint)
    role = ensure_node_roles(aws.client("iam"), ENV, [POOL])[POOL]
    node_sm = as_node(aws, "secretsmanager", node_credentials(aws.client("sts"), role, INSTANCE))
    files = fetch_secrets(node_sm, config, tmp_path / "node")

    assert files.secrets["server-api-token"].read_text() == secrets.server_api_token.read_text()
    assert files.secrets["kv-channel-key"].read_text() == secrets.kv_channel_key.read_text()
    assert files.tls["ca.crt"].read_text() == ca.ca_cert.read_text()
    cert = x509.load_pem_x509_certificate(files.tls["tls.crt"].read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.ca_cert.read_bytes()))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["prefill.dc1.local.pdstack", "*.prefill.dc1.local.pdstack"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == POOL_ADDRESSES

    rotated = values | {"server-api-token": "rotated"}
    assert seed_secrets(sm, ENV, rotated) == [secret_name(ENV, "server-api-token")]
    assert fetch_secrets(node_sm, config, tmp_path / "again").secrets["server-api-token"].read_text() == "rotated"


def test_the_scheduler_url_is_where_a_joining_node_reads_it(aws: LocalAws) -> None:
    ssm = aws.client("ssm")
    url = "https://scheduler.control.local.pdstack:8443"
    assert seed_scheduler_url(ssm, ENV, url) is True
    assert seed_scheduler_url(ssm, ENV, url) is False
    assert scheduler_url(ssm, scheduler_url_parameter(ENV)) == url


def test_buckets_hold_a_published_release(aws: LocalAws, stacks: EnvironmentStacks, tmp_path: Path) -> None:
    s3 = aws.client("s3")
    buckets = ensure_buckets(s3, ENV, gpu_datacenters(stacks))
    assert ensure_buckets(s3, ENV, gpu_datacenters(stacks)) == buckets
    assert buckets == {"dc1": f"pdstack-local-dc1-{ACCOUNT}", "dc2": f"pdstack-local-dc2-{ACCOUNT}"}

    bundle = tmp_path / "bundle.tar.gz"
    bundle.write_bytes(b"bundle")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    image = "10.210.255.1:5000/pdserve@sha256:" + "a" * 64
    published = publish_local_release(
        aws,
        stacks,
        release="r1",
        bundle=bundle,
        model_dir=model,
        model_name="tiny",
        model_revision="main",
        images={"pdserve": image},
    )
    assert published.record.buckets == buckets
    assert read_release(aws.client("ssm"), ENV).release == "r1"
    for bucket in buckets.values():
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
        assert keys == {published.record.bundle.key, "models/tiny/main/config.json"}


def test_a_pools_group_hands_out_instances_a_node_can_mark_unhealthy(aws: LocalAws) -> None:
    asg, ec2 = aws.client("autoscaling"), aws.client("ec2")
    instances = ensure_groups(asg, ec2, ENV, {POOL: 2}, heartbeat_timeout=120)[POOL]
    assert len(instances) == 2
    assert ensure_groups(asg, ec2, ENV, {POOL: 2}, heartbeat_timeout=120)[POOL] == instances  # again: the same
    group = node_group_name(ENV, *POOL)
    hooks = asg.describe_lifecycle_hooks(AutoScalingGroupName=group)["LifecycleHooks"]
    assert [(h["LifecycleHookName"], h["HeartbeatTimeout"]) for h in hooks] == [("pdstack-drain", 120)]

    role = ensure_node_roles(aws.client("iam"), ENV, [POOL])[POOL]
    mark_unhealthy(as_node(aws, "autoscaling", node_credentials(aws.client("sts"), role, instances[0])), instances[0])
    found = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"][0]["Instances"]
    assert {i["InstanceId"]: i["HealthStatus"] for i in found} == {instances[0]: "Unhealthy", instances[1]: "Healthy"}


def test_a_restarted_aws_is_empty_and_seeds_again(tmp_path: Path) -> None:
    local = LocalAws(tmp_path / "state", "127.0.0.1", free_port())
    _, _, values = seeded_values(tmp_path)
    local.start()
    try:
        seed_secrets(local.client("secretsmanager"), ENV, values)
        pid = local.pid()
        local.start()  # running and healthy: left alone
        assert local.pid() == pid
        local.stop()
        assert local.pid() is None and not local.healthy()
        local.start()
        sm = local.client("secretsmanager")
        assert sm.list_secrets()["SecretList"] == []
        assert len(seed_secrets(sm, ENV, values)) == len(values)
    finally:
        local.stop()


# -- the registry's login


def test_the_registry_accepts_what_ecr_hands_a_node(aws: LocalAws, registry: Registry) -> None:
    host = registry.endpoint
    auth = registry_auths([host], "us-east-1", lambda region: aws.client("ecr", region))[host]  # the node's own way
    assert base64.b64decode(auth).decode() == ":".join(registry.credentials() or ())
    assert registry.credentials() == ("AWS", f"{ACCOUNT}-auth-token")
    assert registry.healthy()

    anonymous = httpx.get(f"http://{host}/v2/_catalog", timeout=5)
    assert anonymous.status_code == 401
    assert httpx.get(f"http://{host}/v2/_catalog", auth=("AWS", "wrong"), timeout=5).status_code == 401
    logged_in = httpx.get(f"http://{host}/v2/_catalog", headers={"Authorization": f"Basic {auth}"}, timeout=5)
    assert logged_in.status_code == 200


@pytest.fixture(scope="module")
def pushed(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-file image pushed with the registry's login; its reference by digest."""
    folder = tmp_path_factory.mktemp("tiny")
    (folder / "hello").write_text("hello\n")
    tar = subprocess.run(["tar", "-C", str(folder), "-c", "hello"], capture_output=True, check=True).stdout
    subprocess.run(["podman", "import", "-", TINY_IMAGE], input=tar, capture_output=True, check=True)
    try:
        yield registry.push(TINY_IMAGE, "pdstack/tiny", "35")
    finally:
        subprocess.run(["podman", "rmi", "-f", TINY_IMAGE], capture_output=True, check=False)


def test_anonymous_pulls_are_refused_and_the_login_pulls(
    registry: Registry, pushed: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    manifest = f"http://{registry.endpoint}/v2/pdstack/tiny/manifests/35"
    assert httpx.get(manifest, timeout=5).status_code == 401
    accept = {
        "Accept": "application/vnd.oci.image.manifest.v1+json,application/vnd.docker.distribution.manifest.v2+json"
    }
    assert httpx.get(manifest, auth=registry.credentials(), headers=accept, timeout=5).status_code == 200

    run_root = Path(tempfile.mkdtemp(prefix="pds35-", dir="/tmp"))  # podman takes a run root of 50 characters at most
    request.addfinalizer(lambda: shutil.rmtree(run_root, ignore_errors=True))

    def pull(home: Path) -> subprocess.CompletedProcess[str]:
        """podman in a store of its own, reading root's default auth file under `home` (no REGISTRY_AUTH_FILE)."""
        store = ["--root", str(tmp_path / "root"), "--runroot", str(run_root), "--storage-driver", "vfs"]
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home)}
        argv = ["podman", *store, "pull", "--tls-verify=false", pushed]
        return subprocess.run(argv, capture_output=True, text=True, env=env, check=False)

    refused = pull(tmp_path / "nobody")
    assert refused.returncode != 0 and "unauthorized" in refused.stderr.lower()

    # what roles/container_runtime writes from registry_auth_vars, at NODE_AUTH_FILE relative to root's home
    variables = registry_auth_vars(registry)
    specs = yaml.safe_load((ROOT / "roles/container_runtime/meta/argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert set(variables) <= set(options)
    (entry,) = variables["container_runtime_registry_auths"]
    assert set(entry) == set(options["container_runtime_registry_auths"]["options"])
    home = tmp_path / "root-home"
    auth_file = home / Path(NODE_AUTH_FILE).relative_to("/root")
    auth_file.parent.mkdir(parents=True)
    login = base64.b64encode(f"{entry['username']}:{entry['password']}".encode()).decode()
    auth_file.write_text(json.dumps({"auths": {entry["registry"]: {"auth": login}}}))
    assert variables["container_runtime_auth_file"] == NODE_AUTH_FILE
    assert pull(home).returncode == 0, pull(home).stderr


def test_a_registry_started_again_keeps_running_and_an_anonymous_one_takes_the_login(
    registry: Registry, tmp_path: Path
) -> None:
    pid = registry.pid()
    registry.start()
    assert registry.pid() == pid
    assert (registry.auth_file.stat().st_mode & 0o777) == 0o600

    anonymous = Registry(tmp_path, "127.0.0.1", free_port())
    assert anonymous.credentials() is None and registry_auth_vars(anonymous) == {}
    anonymous.start()
    try:
        catalog = f"http://{anonymous.endpoint}/v2/_catalog"
        assert httpx.get(catalog, timeout=5).status_code == 200
        # the same registry given a login (an environment made before its registry had one): restarted, refusing
        logged = Registry(tmp_path, anonymous.address, anonymous.port, registry.credentials())
        logged.start()
        assert logged.pid() != pid and httpx.get(catalog, timeout=5).status_code == 401
    finally:
        anonymous.stop()


def test_up_seeds_what_a_node_reads_and_the_scheduler_admits_the_pools_roles(aws: LocalAws, tmp_path: Path) -> None:
    """seed_local_aws (what `up` runs): the node secrets and each pool's certificate in Secrets Manager, the
    scheduler's URL, the buckets and roles; its join settings are ones the scheduler loads, naming each GPU pool's
    role as the component its nodes are."""
    topology = load_topology(ROOT / "stacks")
    LocalSecrets(tmp_path / "secrets").ensure()
    local_ca(tmp_path).ensure([])
    join = seed_local_aws(aws, topology, LocalSecrets(tmp_path / "secrets"), tmp_path)
    names = {s["Name"] for s in aws.client("secretsmanager").list_secrets()["SecretList"]}
    assert {"pdstack/local/tls/dc1/prefill", "pdstack/local/tls/dc2/decode"} <= names
    fields = {name.removeprefix("PDSERVE_").lower(): value for name, value in join.items()}
    admin, key = tmp_path / "admin.token", tmp_path / "identity.key"
    admin.write_text("a" * 40)
    key.write_text("k" * 40)
    scheduler = SchedulerSettings(
        state_file=tmp_path / "state.json", admin_token_file=admin, identity_key_file=key, **fields
    )
    assert scheduler.join_sts_url == aws.endpoint + "/"
    assert {f"{arn}={component}" for arn, component in scheduler.join_node_roles.items()} == {
        f"arn:aws:iam::{ACCOUNT}:role/pdstack-local-dc1-prefill-node=prefill",
        f"arn:aws:iam::{ACCOUNT}:role/pdstack-local-dc2-decode-node=decode",
    }
