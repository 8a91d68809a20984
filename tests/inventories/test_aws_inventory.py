"""inventories/aws for real: a moto server on loopback holds EC2 instances launched with exactly the tags the Pulumi
program's launch templates carry (from `pdstack synth --env prod --json`, run from a subfolder) and the secrets the
program creates (by the names it gives them); `ansible-inventory -i inventories/aws --list` and a playbook on the
controller then see them as the playbooks expect."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
import yaml

from infra.lambdas import pool_records
from pdserve.scheduler.identity import derive_token
from pdstack.contract.cloud_inventory import render
from pdstack.contract.components import (
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    Component,
    ca_certificate_parameter,
    cloud_names,
    contract,
    operator_tls_secret_name,
    prometheus_url_parameter,
    tls_secret_name,
)
from pdstack.contract.files import environment_alerting, environment_serving, render_ansible_vars
from pdstack.model import REQUIRED_SECRETS
from pdstack.stacks.environment import load_environment
from tests.inventories.scheduler_calls import scheduler_calls
from tests.support import REPO
from tests.support.ports import free_port
from tests.support.tlsfiles import relocated, write_tls_dir

BIN = Path(sys.executable).parent
INVENTORY = REPO / "inventories" / "aws"
PROBE = Path(__file__).with_name("probe.yml")
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
SECRET = "aws:secretsmanager/secret:Secret"
PER_TEMPLATE = {"prefill": 2, "decode": 2, "control": 1}


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/moto-api/", timeout=1)
                break
            except httpx.TransportError:
                assert server.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def aws_env(moto: str) -> dict[str, str]:
    """What the controller has: fake credentials, the endpoint pointed at moto, the environment to list."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ANSIBLE_", "PDSTACK_"))}
    return env | {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": moto,
        "AWS_DEFAULT_REGION": "us-east-1",
        "PDSTACK_ENVIRONMENT": "prod",
        "ANSIBLE_INVENTORY_UNPARSED_FAILED": "true",
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true",
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }


@pytest.fixture(scope="module")
def synthesised() -> list[dict[str, Any]]:
    result = subprocess.run(
        [str(BIN / "pdstack"), "synth", "--env", "prod", "--json"],
        cwd=REPO / "roles",
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    stacks: list[dict[str, Any]] = json.loads(result.stdout)["stacks"]
    assert [s["stack"] for s in stacks] == ["prod-control", "prod-decode-us-west-2", "prod-prefill-us-east-1"]
    return stacks


def instance_tags(resource: dict[str, Any]) -> dict[str, str]:
    specs = resource["inputs"]["tagSpecifications"]
    return next(s["tags"] for s in specs if s["resourceType"] == "instance")


@pytest.fixture(scope="module")
def launched(synthesised: list[dict[str, Any]], moto: str, aws_env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Instances launched with each launch template's instance tags, in its stack's region; by instance id."""
    out: dict[str, dict[str, Any]] = {}
    for stack in synthesised:
        region = stack["outputs"]["region"]
        ec2 = boto3.client(
            "ec2", region_name=region, endpoint_url=moto, aws_access_key_id="testing", aws_secret_access_key="testing"
        )
        image = ec2.describe_images()["Images"][0]["ImageId"]
        for template in (r for r in stack["resources"] if r["type"] == LAUNCH_TEMPLATE):
            tags = instance_tags(template)
            count = PER_TEMPLATE[tags["pdstack:role"]]
            made = ec2.run_instances(
                ImageId=image,
                MinCount=count,
                MaxCount=count,
                InstanceType="t3.micro",
                TagSpecifications=[
                    {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
                ],
            )
            for instance in made["Instances"]:
                out[instance["InstanceId"]] = {"tags": tags, "region": region, "ip": instance["PrivateIpAddress"]}
        if stack["stack"] == "prod-prefill-us-east-1":  # neighbours to leave out: another environment's, untagged
            other = {
                **instance_tags(next(r for r in stack["resources"] if r["type"] == LAUNCH_TEMPLATE)),
                "pdstack:env": "staging",
            }
            ec2.run_instances(
                ImageId=image,
                MinCount=1,
                MaxCount=1,
                TagSpecifications=[
                    {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in other.items()]}
                ],
            )
            ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)
    assert {t["tags"]["pdstack:role"] for t in out.values()} == {"prefill", "decode", "control"}
    return out


def unwrap(value: Any) -> Any:
    """ansible-inventory marks values that came from outside as {"__ansible_unsafe": value}."""
    if isinstance(value, dict):
        return (
            value["__ansible_unsafe"]
            if set(value) == {"__ansible_unsafe"}
            else {k: unwrap(v) for k, v in value.items()}
        )
    return [unwrap(v) for v in value] if isinstance(value, list) else value


def ansible_inventory(aws_env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(INVENTORY), "--list"],
        cwd=REPO,
        env=aws_env | extra,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_the_committed_inventory_is_rendered_from_the_stacks() -> None:
    for name, text in render(REPO / "stacks").items():
        assert (INVENTORY / name).read_text() == text, f"run `python -m pdstack.contract.cloud_inventory` ({name})"


def test_inventory_groups_and_describes_the_instances_as_the_playbooks_expect(
    launched: dict[str, dict[str, Any]], aws_env: dict[str, str]
) -> None:
    result = ansible_inventory(aws_env)
    assert result.returncode == 0, result.stderr
    inv = unwrap(json.loads(result.stdout))
    hostvars = inv["_meta"]["hostvars"]
    members = lambda group: set(inv.get(group, {}).get("hosts", []))  # noqa: E731
    by_id = {v["aws_instance_id"]: name for name, v in hostvars.items()}
    gpu = {i: w for i, w in launched.items() if w["tags"]["pdstack:role"] != "control"}
    assert len(gpu) < len(launched), "the control stack's EKS system nodes were launched too"
    # exactly the prod GPU nodes: not staging's, not the untagged one, not the EKS system nodes (EKS manages those)
    assert set(by_id) == set(gpu)
    for instance_id, want in gpu.items():
        name, tags = by_id[instance_id], want["tags"]
        assert name == f"{tags['pdstack:dc']}-{instance_id}"
        got = hostvars[name]
        assert got["pdstack_address"] == want["ip"]
        assert got["ansible_host"] == instance_id  # SSH through SSM targets the instance id
        assert (got["pdstack_environment"], got["pdstack_datacenter"], got["pdstack_role"], got["pdstack_pool"]) == (
            "prod",
            tags["pdstack:dc"],
            tags["pdstack:role"],
            tags["pdstack:pool"],
        )
        assert got["pdstack_region"] == want["region"]
        assert name in members(tags["pdstack:role"])
        assert name in members("dc_" + tags["pdstack:dc"].replace("-", "_"))
        assert name in members("env_prod") and name in members("nodes")
    for role in ("prefill", "decode"):
        assert len(members(role)) == sum(w["tags"]["pdstack:role"] == role for w in launched.values()), role
    # The groups the playbooks name exist (site/serving/deploy/rollback plays and vars/serving.yml's lookups), but
    # `control`: the control plane runs in EKS, and no play may run on its nodes.
    assert "control" not in inv
    for play in ("baseline", "serving", "deploy", "rollback"):
        for hosts in (
            p["hosts"] for p in yaml.safe_load((REPO / "playbooks" / f"{play}.yml").read_text()) if "hosts" in p
        ):
            for group in str(hosts).split(":"):
                if group not in ("localhost", "canary", "promote", "control") and "{{" not in group:
                    assert members(group), (play, group)


def test_inventory_needs_the_environment_named(launched: dict[str, dict[str, Any]], aws_env: dict[str, str]) -> None:
    env = {k: v for k, v in aws_env.items() if k != "PDSTACK_ENVIRONMENT"}
    result = subprocess.run(
        [str(BIN / "ansible-inventory"), "-i", str(INVENTORY), "--list"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode != 0
    assert "set PDSTACK_ENVIRONMENT to one of dev, staging, prod" in result.stderr
    staging = ansible_inventory(aws_env, PDSTACK_ENVIRONMENT="staging")
    assert staging.returncode == 0, staging.stderr
    assert len(json.loads(staging.stdout)["_meta"]["hostvars"]) == 1


def stored_secrets(manager: Any, names: list[str]) -> dict[str, str]:
    """The secrets by the names the program gives them, stored in moto once (random values); by stack secret name."""
    present = {s["Name"] for s in manager.list_secrets()["SecretList"]}
    for name in set(names) - present:
        manager.create_secret(Name=name, SecretString=secrets.token_urlsafe(32))
    return {name.rsplit("/", 1)[1]: manager.get_secret_value(SecretId=name)["SecretString"] for name in names}


def test_host_variables_render_for_the_roles_and_secrets_come_from_secrets_manager(
    launched: dict[str, dict[str, Any]],
    synthesised: list[dict[str, Any]],
    moto: str,
    aws_env: dict[str, str],
    tmp_path: Path,
) -> None:
    control = next(s for s in synthesised if s["stack"] == "prod-control")
    # The serving secrets the roles read (pdstack:secrets); the pools' TLS keys (pdstack/<env>/tls/...) are not theirs.
    names = [
        r["inputs"]["name"] for r in control["resources"] if r["type"] == SECRET and "/tls/" not in r["inputs"]["name"]
    ]
    assert len(names) == len(REQUIRED_SECRETS)
    manager = boto3.client(
        "secretsmanager",
        region_name=control["outputs"]["region"],
        endpoint_url=moto,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    values = stored_secrets(manager, names)
    expected = json.dumps(values, sort_keys=True)

    def probe(sha256: str) -> subprocess.CompletedProcess[str]:
        run = subprocess.run(
            [
                str(BIN / "ansible-playbook"),
                "-i",
                str(INVENTORY),
                str(PROBE),
                "-e",
                f"probe_out={tmp_path}",
                "-e",
                f"probe_expected_sha256={sha256}",
                "-vvv",
            ],
            cwd=REPO,
            env=aws_env,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        for value in values.values():
            assert value not in run.stdout + run.stderr, "a secret value was logged"
        return run

    wrong = probe(hashlib.sha256(b"not the secrets").hexdigest())  # the check can fail, and says nothing then either
    assert wrong.returncode != 0 and "censored" in wrong.stdout
    result = probe(hashlib.sha256(expected.encode()).hexdigest())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    links = load_environment(REPO / "stacks", "prod").configs
    datacenter_access = {
        stack["stack"].removeprefix("prod-"): {
            "bucket": stack["outputs"]["transfer_bucket"],
            "document": stack["outputs"]["session_document"],
        }
        for stack in synthesised
        if stack["stack"] != "prod-control"
    }
    for instance_id, want in ((i, w) for i, w in launched.items() if w["tags"]["pdstack:role"] != "control"):
        dc = want["tags"]["pdstack:dc"]
        seen = json.loads((tmp_path / f"{dc}-{instance_id}.json").read_text())
        widest = max(
            (link for name, cfg in links.items() for link in cfg.datacenter.links if dc in (name, link.peer)),
            key=lambda link: link.bandwidth_gbps * link.rtt_ms,
        )
        assert (seen["bandwidth_gbps"], seen["rtt_ms"]) == (widest.bandwidth_gbps, widest.rtt_ms)
        # through SSM Session Manager, into the names the datacenter's stack gives its session document and transfer
        # bucket (infra/operator_access.py, as `pdstack synth` makes them)
        made = datacenter_access[dc]
        assert seen["connection"] == {
            "plugin": "amazon.aws.aws_ssm",
            "instance_id": instance_id,
            "region": want["region"],
            "bucket": made["bucket"],
            "document": made["document"],
            "become": True,
        }
        assert seen["time_sync_aws"] is True


def test_the_inventory_keys_on_the_tags_the_program_puts_on_instances() -> None:
    from infra import tags  # noqa: PLC0415 (the program's module, plain Python)
    from pdstack.contract import cloud_inventory  # noqa: PLC0415

    keys = (cloud_inventory.ENV_TAG, cloud_inventory.DC_TAG, cloud_inventory.ROLE_TAG, cloud_inventory.POOL_TAG)
    assert keys == tags.INSTANCE_TAG_KEYS


def test_the_inventory_reads_the_zone_from_the_setting_the_program_reads() -> None:
    from infra import environment  # noqa: PLC0415 (the program's module, plain Python)
    from pdstack.contract import cloud_inventory  # noqa: PLC0415

    assert f"{environment.SETTINGS_NAMESPACE}:dns_domain" == cloud_inventory.DNS_DOMAIN_KEY


def podman_store(folder: Path) -> dict[str, str]:
    """Point podman at a store of the test's own (its secrets, locks and temporary files), so nothing here touches
    the host's containers or secrets."""
    (folder / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{folder}/root"\nrunroot = "{folder}/run"\n'
    )
    (folder / "containers.conf").write_text(f'[engine]\ntmp_dir = "{folder}/tmp"\nvolume_path = "{folder}/volumes"\n')
    return {"CONTAINERS_STORAGE_CONF": str(folder / "storage.conf"), "CONTAINERS_CONF": str(folder / "containers.conf")}


def podman_secrets(store: dict[str, str], folder: Path) -> dict[str, str]:
    """name -> content of the secrets in the test's podman store (its file driver's data)."""
    listed = subprocess.run(
        ["podman", "secret", "ls", "--format", "{{.ID}} {{.Name}}"],
        env={**os.environ, **store},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    data = json.loads((folder / "root" / "secrets" / "filedriver" / "secretsdata.json").read_text())
    return {name: base64.b64decode(data[ident]).decode() for ident, name in (line.split() for line in listed if line)}


def test_the_pdserve_role_makes_podman_secrets_from_secrets_manager_without_logging_them(
    synthesised: list[dict[str, Any]], moto: str, aws_env: dict[str, str], tmp_path: Path
) -> None:
    """A prefill node's secrets: the KV key and the server token as stored, the identity key only as the token
    derived for this instance (the key itself never reaches the node), mounted where the contract says."""
    control = next(s for s in synthesised if s["stack"] == "prod-control")
    manager = boto3.client(
        "secretsmanager",
        region_name=control["outputs"]["region"],
        endpoint_url=moto,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    values = stored_secrets(manager, [r["inputs"]["name"] for r in control["resources"] if r["type"] == SECRET])
    store = podman_store(tmp_path)
    engine_id = "prefill-us-east-1-0123abcd"
    try:
        run = subprocess.run(
            [
                str(BIN / "ansible-playbook"),
                "-i",
                str(INVENTORY),
                str(PROBE.with_name("role_secrets.yml")),
                "-e",
                "@" + str(REPO / "playbooks" / "vars" / "contract" / "prod.yml"),
                "-e",
                "probe_component=prefill",
                "-e",
                f"probe_engine_id={engine_id}",
                "-e",
                f"probe_out={tmp_path}",
                "-vvv",
            ],
            cwd=REPO,
            env=aws_env | store,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        for value in values.values():
            assert value not in run.stdout + run.stderr, "a secret value was logged"
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        made = podman_secrets(store, tmp_path)
    finally:
        subprocess.run(
            ["podman", "secret", "rm", "--all"], env={**os.environ, **store}, capture_output=True, check=False
        )
    contract = yaml.safe_load((REPO / "playbooks" / "vars" / "contract" / "prod.yml").read_text())
    wanted = contract["pdserve_components"]["prefill"]["secrets"]
    token = derive_token(values["scheduler-identity-key"], f"instance:prefill-{engine_id}")
    expected = {s["name"]: token if s.get("principal") == "instance" else values[s["secret"]] for s in wanted}
    assert {name.rsplit("-", 1)[0]: content for name, content in made.items()} == expected
    assert values["scheduler-identity-key"] not in made.values()
    mounts = json.loads((tmp_path / "mounts.json").read_text())
    targets = {part.removeprefix("target=") for m in mounts for part in m.split(",") if part.startswith("target=")}
    assert targets == {s["target"] for s in wanted}


def test_serving_plays_skip_the_eks_nodes_and_reach_the_scheduler_at_its_load_balancer(
    launched: dict[str, dict[str, Any]],
    synthesised: list[dict[str, Any]],
    moto: str,
    aws_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """The control-plane stack's SSM parameters (as `pdstack synth` names and fills them) hold the scheduler's and
    Prometheus' https URLs by the private zone's names; through inventories/aws, serving.yml runs no control play, the
    GPU nodes and the controller's weights calls use the scheduler's URL, and the controller's canary judge
    (deploy.yml) queries Prometheus' URL."""
    control = next(s for s in synthesised if s["stack"] == "prod-control")
    parameters = {r["name"]: r["inputs"] for r in control["resources"] if r["type"] == "aws:ssm/parameter:Parameter"}
    assert parameters["prometheus-url"]["name"] == prometheus_url_parameter("prod")
    # the values as the stack writes them (synth redacts SSM values: pulumi-aws marks them secret; tests/infra checks
    # the values themselves): https, by the private zone's names, on the listeners' ports
    names = {r["name"]: r["inputs"]["name"] for r in control["resources"] if r["type"] == "aws:route53/record:Record"}
    served = contract(environment_serving(REPO / "stacks", "prod"))
    url = f"https://{names['scheduler-name']}:{served[Component.SCHEDULER].port}"
    prometheus_url = f"https://{names['prometheus-name']}:{served.prometheus.port}"
    ssm = boto3.client(
        "ssm",
        region_name=control["outputs"]["region"],
        endpoint_url=moto,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    for name, value in (("scheduler-url", url), ("prometheus-url", prometheus_url)):
        ssm.put_parameter(Name=parameters[name]["name"], Value=value, Type=parameters[name]["type"], Overwrite=True)

    listed = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(INVENTORY),
            str(REPO / "playbooks" / "serving.yml"),
            "--list-hosts",
            "-e",
            "pdstack_environment=prod",
        ],
        cwd=REPO,
        env=aws_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    plays = re.findall(r"pattern: \[(.*?)\]\n\s+hosts \((\d+)\)", listed.stdout)
    by_pattern = {pattern.strip("'"): int(count) for pattern, count in plays}
    assert by_pattern["control"] == 0, listed.stdout  # no control play runs on the EKS nodes
    for role in ("prefill", "decode"):
        assert by_pattern[role] == sum(w["tags"]["pdstack:role"] == role for w in launched.values())

    seen = scheduler_calls(tmp_path, INVENTORY, "-e", "pdstack_environment=prod", env=aws_env)
    gpu = [i for i, w in launched.items() if w["tags"]["pdstack:role"] != "control"]
    assert len(seen) == len(gpu) + 1
    for name, got in seen.items():  # the role's weights calls run where they are templated: on the controller
        assert got == {"scheduler_url": url, "weights_host": name, "prometheus_url": prometheus_url}, name
    assert seen["localhost"]["weights_host"] == "localhost"


def put_secret(manager: Any, name: str, value: str) -> None:
    if name in {s["Name"] for s in manager.list_secrets()["SecretList"]}:
        manager.put_secret_value(SecretId=name, SecretString=value)
    else:
        manager.create_secret(Name=name, SecretString=value)


def store_pool_certificates(manager: Any, control: dict[str, Any], folder: Path) -> dict[str, dict[str, str]]:
    """Each pool's secret as the program stores it (JSON of its tls.crt, tls.key and ca.crt), with a real
    certificate for the pool's name and the wildcard under it; by secret name."""
    zone = cloud_names("prod").zone
    stored: dict[str, dict[str, str]] = {}
    for name in (
        r["inputs"]["name"] for r in control["resources"] if r["type"] == SECRET and "/tls/" in r["inputs"]["name"]
    ):
        dc, pool = name.split("/")[-2:]
        pool_name = f"{pool}.{dc}.{zone}"
        files = write_tls_dir(folder / dc / pool, [pool_name, f"*.{pool_name}"])
        stored[name] = {f.name: f.read_text() for f in files.iterdir()}
        put_secret(manager, name, json.dumps(stored[name]))
    return stored


def cloud_plays(tmp_path: Path, mutual_tls: bool) -> tuple[Path, Path]:
    """The inventory and a play folder (the probe beside playbooks/vars and controller_tls.yml, as the playbooks
    are); with `mutual_tls`, both rendered from a copy of the stacks whose control plane sets serving.mutual_tls."""
    play_dir = tmp_path / "play"
    play_dir.mkdir()
    (play_dir / "node_tls.yml").symlink_to(PROBE.with_name("node_tls.yml"))
    (play_dir / "controller_tls.yml").symlink_to(REPO / "playbooks" / "controller_tls.yml")
    if not mutual_tls:
        (play_dir / "vars").symlink_to(REPO / "playbooks" / "vars")
        return INVENTORY, play_dir
    stacks = shutil.copytree(REPO / "stacks", tmp_path / "stacks")
    control = stacks / "Pulumi.prod-control.yaml"
    data = yaml.safe_load(control.read_text())
    data["config"]["pdstack:serving"]["mutual_tls"] = True
    control.write_text(yaml.safe_dump(data))
    shutil.copytree(REPO / "playbooks" / "vars", play_dir / "vars")
    serving, alerting = environment_serving(stacks, "prod"), environment_alerting(stacks, "prod")
    (play_dir / "vars" / "contract" / "prod.yml").write_text(render_ansible_vars("prod", serving, alerting))
    inventory = shutil.copytree(INVENTORY, tmp_path / "inventory")
    for name, text in render(stacks).items():
        (inventory / name).write_text(text)
    return inventory, play_dir


def serves_by_name(folder: Path, name: str) -> bool:
    """Whether a client verifying `name` against folder's CA accepts a TLS listener serving folder's pair."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(folder / TLS_CERT_FILE, folder / TLS_KEY_FILE)
    client = ssl.create_default_context(cafile=folder / TLS_CA_FILE)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepted = threading.Thread(target=lambda: _handshake(listener, server), daemon=True)
        accepted.start()
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=5) as raw,
                client.wrap_socket(raw, server_hostname=name),
            ):
                return True
        except ssl.SSLCertVerificationError:
            return False
        finally:
            accepted.join(timeout=5)


def _handshake(listener: socket.socket, context: ssl.SSLContext) -> None:
    conn, _ = listener.accept()
    with contextlib.suppress(ssl.SSLError, OSError), context.wrap_socket(conn, server_side=True):
        pass


@pytest.mark.parametrize("mutual_tls", [False, True], ids=["tls", "mutual-tls"])
def test_each_node_serves_its_pools_certificate_from_secrets_manager_by_its_own_name(  # noqa: PLR0917 (fixtures)
    launched: dict[str, dict[str, Any]],
    synthesised: list[dict[str, Any]],
    moto: str,
    aws_env: dict[str, str],
    tmp_path: Path,
    mutual_tls: bool,
) -> None:
    """Through inventories/aws, each GPU node advertises its instance's own name (the record the pool's reconciler
    keeps), the pdserve role and node_exporter's TLS files are its pool's Secrets Manager secret (never logged), the
    pool's certificate verifies by that name, and the node calls the scheduler over https. The controller's calls
    verify the CA from SSM and, under mutual TLS, present the operator's certificate from Secrets Manager."""
    control = next(s for s in synthesised if s["stack"] == "prod-control")
    region = control["outputs"]["region"]

    def client(service: str) -> Any:
        return boto3.client(
            service, region_name=region, endpoint_url=moto, aws_access_key_id="testing", aws_secret_access_key="testing"
        )

    manager = client("secretsmanager")
    stored_secrets(
        manager,
        [
            r["inputs"]["name"]
            for r in control["resources"]
            if r["type"] == SECRET and "/tls/" not in r["inputs"]["name"]
        ],
    )
    pools = store_pool_certificates(manager, control, tmp_path / "issued")
    operator = write_tls_dir(tmp_path / "issued" / "operator", ["operator.control.prod.pdstack.internal"])
    operator_files = {f.name: f.read_text() for f in operator.iterdir()}
    put_secret(manager, operator_tls_secret_name("prod"), json.dumps(operator_files))
    ca_pem = next(iter(pools.values()))[TLS_CA_FILE]
    for parameter, value in (
        (ca_certificate_parameter("prod"), ca_pem),
        ("/pdstack/prod/scheduler-url", "https://scheduler.control.prod.pdstack.internal:8100"),
    ):
        client("ssm").put_parameter(Name=parameter, Value=value, Type="String", Overwrite=True)
    inventory, play_dir = cloud_plays(tmp_path, mutual_tls)
    out = tmp_path / "out"
    run = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            str(inventory),
            str(play_dir / "node_tls.yml"),
            "-e",
            "pdstack_environment=prod",
            "-e",
            f"probe_out={out}",
            "-vvv",
        ],
        cwd=REPO,
        env=aws_env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    keys = [files[TLS_KEY_FILE] for files in [*pools.values(), operator_files]]
    assert not any(key.strip().splitlines()[1] in run.stdout + run.stderr for key in keys), "a key was logged"
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    gpu = {i: w for i, w in launched.items() if w["tags"]["pdstack:role"] != "control"}
    for instance_id, want in gpu.items():
        dc, pool = want["tags"]["pdstack:dc"], want["tags"]["pdstack:pool"]
        host = out / f"{dc}-{instance_id}"
        seen = json.loads((host / "seen.json").read_text())
        name = pool_records.instance_name(instance_id, cloud_names("prod").host(pool, dc))
        assert seen["address"] == seen["node_exporter_name"] == seen["vllm_address"] == name
        assert seen["scheme"] == "https" and seen["scheduler_url"].startswith("https://")
        assert seen["tls_env"]["PDSERVE_TLS_CA"].endswith("/" + TLS_CA_FILE)
        assert seen["tls_env"]["PDSERVE_TLS_CLIENT_AUTH"] == ("required" if mutual_tls else "none")
        for folder in (host / "pdserve", host / "node_exporter"):
            files = pools[tls_secret_name("prod", dc, pool)]
            assert {f: (folder / f).read_text() for f in files} == files
            assert serves_by_name(folder, name)
            assert not serves_by_name(folder, f"{instance_id}.another-pool.{dc}.prod.pdstack.internal")
        assert stat.S_IMODE((host / "pdserve" / TLS_KEY_FILE).stat().st_mode) == 0o400
        web = yaml.safe_load((host / "node_exporter" / "web.yml").read_text())["tls_server_config"]
        assert ("client_auth_type" in web) is mutual_tls
    controller = json.loads((out / "controller.json").read_text())
    ca_file = controller["env"]["SSL_CERT_FILE"]
    assert controller["scheme"] == "https" and Path(ca_file).read_text().strip() == ca_pem.strip()
    if not mutual_tls:
        assert "PDSTACK_TLS_CLIENT_CERT" not in controller["env"] and controller["weights"] == [ca_file, "", ""]
        return
    cert, key = controller["env"]["PDSTACK_TLS_CLIENT_CERT"], controller["env"]["PDSTACK_TLS_CLIENT_KEY"]
    assert (Path(cert).read_text(), Path(key).read_text()) == (
        operator_files[TLS_CERT_FILE],
        operator_files[TLS_KEY_FILE],
    )
    assert stat.S_IMODE(Path(key).stat().st_mode) == 0o600
    assert controller["weights"] == [ca_file, cert, key]


def test_the_clouds_prometheus_scrapes_each_node_over_https_by_its_own_name(
    launched: dict[str, dict[str, Any]], synthesised: list[dict[str, Any]], moto: str, tmp_path: Path
) -> None:
    """A real Prometheus with the control-plane stack's scrape configuration, its EC2 discovery pointed at moto:
    every GPU node's target is https://<the name the pool's reconciler keeps>:<port> (which the pool's certificate
    carries), never its address."""
    control = next(s for s in synthesised if s["stack"] == "prod-control")
    maps = [r["inputs"] for r in control["resources"] if r["type"] == "kubernetes:core/v1:ConfigMap"]
    config = yaml.safe_load(next(m["data"] for m in maps if m["metadata"]["name"] == "prometheus")["prometheus.yml"])
    tls = write_tls_dir(tmp_path / "tls", ["prometheus"])
    jobs = [j for j in config["scrape_configs"] if "ec2_sd_configs" in j]
    for job in jobs:
        job["tls_config"] = {k: relocated(v, tls) for k, v in job["tls_config"].items()}
        for sd in job["ec2_sd_configs"]:  # the test's own endpoint and credentials
            sd |= {"endpoint": moto, "access_key": "testing", "secret_key": "testing", "refresh_interval": "1s"}
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs})
    )
    port = free_port()
    with (tmp_path / "prometheus.log").open("w") as log:
        server = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=log,
        )
    gpu = {i: w for i, w in launched.items() if w["tags"]["pdstack:role"] != "control"}
    wanted = {
        (j["job_name"], i)
        for j in jobs
        for i, w in gpu.items()
        if j["job_name"] == "node" or j["job_name"] == f"pdserve-{w['tags']['pdstack:role']}"
    }
    try:
        deadline, targets = time.monotonic() + 60, []
        while len(targets) < len(wanted) and time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=2)
                if answer.status_code == 200:  # 503 while Prometheus is still starting
                    targets = answer.json()["data"]["activeTargets"]
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert {(t["labels"]["job"], t["labels"]["instance_id"]) for t in targets} == wanted
    for target in targets:
        tags = gpu[target["labels"]["instance_id"]]["tags"]
        name = pool_records.instance_name(
            target["labels"]["instance_id"], cloud_names("prod").host(tags["pdstack:pool"], tags["pdstack:dc"])
        )
        assert target["scrapeUrl"].startswith(f"https://{name}:"), target["scrapeUrl"]
        assert target["labels"]["instance"].split(":")[0] == name
