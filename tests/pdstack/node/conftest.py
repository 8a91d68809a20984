"""The AWS a node bootstraps against, for real over HTTP: one moto server for the whole folder, reset and seeded
for each test with what the deploy flow and the Pulumi program leave there (the release record, the environment's
secrets and the pool's certificate, the model and the node bundle in the datacenter's bucket, the pool's Auto
Scaling group with this instance in it), and the scheduler a node joins: one process for the folder with join on for
the pool's node role, moto as its STS, its URL in the environment's scheduler-url parameter, on https requiring a client
certificate as the local environment runs it (serving.mutual_tls: the node presents its pool's); each node's instance
role credentials are moto's AssumeRole of that role in a session named by its instance id."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdstack.contract.components import scheduler_audience, scheduler_url_parameter
from pdstack.contract.node_lifecycle import node_role_arn, node_role_name
from pdstack.node.apply import PlaybookRun
from pdstack.node.bootstrap import BootstrapResult, NodePaths, bootstrap
from pdstack.node.config import NodeConfig
from pdstack.node.release import ModelFile, ModelRelease, NodeBundle, ReleaseRecord, publish_release
from pdstack.node.secrets import TLS_FILES
from pdstack.node.userdata import node_config
from pdstack.stacks.environment import load_environment
from tests.support import STACKS
from tests.support.joining import MutualTlsService, assume, ensure_role, join_scheduler
from tests.support.motoserver import ACCOUNT, client, moto_server

DIGEST = "sha256:" + "ab" * 32
# the model: a few small files, one in a sub-folder, one empty
MODEL_FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}\n',
    "model-00001-of-00002.safetensors": bytes(range(256)) * 1200,
    "model-00002-of-00002.safetensors": b"\x07" * 200_000,
    "tokenizer/tokenizer.json": b'{"version": "1.0"}\n',
    "tokenizer/empty.txt": b"",
}
PLAYBOOK = b"- name: The node applies its roles to itself\n  hosts: all\n  tasks: []\n"


def bundle_bytes() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in {"playbooks/node.yml": PLAYBOOK, "ansible.cfg": b"[defaults]\n"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


BUNDLE = bundle_bytes()


@dataclass
class Node:
    """One node about to boot, and the AWS around it."""

    url: str
    config: NodeConfig
    record: ReleaseRecord
    instance_id: str
    group: str
    bucket: str
    paths: NodePaths
    runs: list[PlaybookRun] = field(default_factory=list)
    credentials: Any = None  # the instance role's: moto's AssumeRole of the pool's node role, session = instance id
    scheduler: MutualTlsService | None = None

    def client(self, service: str, region: str | None = None) -> Any:
        return client(self.url, service, region or self.config.aws_region)

    def clients(self, service: str, region: str) -> Any:
        return client(self.url, service, region)

    def runner(self, run: PlaybookRun) -> int:
        self.runs.append(run)
        return 0

    def boot(self, **kwargs: Any) -> BootstrapResult:
        return bootstrap(
            self.config,
            client=kwargs.pop("client", self.clients),
            identify=lambda: self.instance_id,
            runner=kwargs.pop("runner", self.runner),
            paths=self.paths,
            bin_dir=Path("/opt/venv/bin"),
            credentials=kwargs.pop("credentials", lambda: self.credentials),
            **kwargs,
        )

    def publish(self, record: ReleaseRecord) -> None:
        self.record = record
        publish_release(self.client("ssm", self.config.control_region), record, self.config.release_parameter)

    def health(self) -> str:
        answer = self.client("autoscaling").describe_auto_scaling_instances(InstanceIds=[self.instance_id])
        return str(answer["AutoScalingInstances"][0]["HealthStatus"])

    def metrics(self) -> str:
        return (self.paths.textfile_dir / "pdstack_node_bootstrap.prom").read_text()


@pytest.fixture(scope="session")
def moto() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture(scope="session")
def scheduler(
    moto: str, local_config: NodeConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MutualTlsService]:
    """The environment's scheduler with join on for the local dc2 decode pool's node role (its fixed name), as the
    control plane configures it; its URL in the scheduler-url parameter every node of the folder reads."""
    env, dc, pool = str(local_config.environment), local_config.datacenter, local_config.pool
    ensure_role(client(moto, "iam"), node_role_name(env, dc, pool))
    roles = {node_role_arn(ACCOUNT, env, dc, pool): local_config.role}
    folder = tmp_path_factory.mktemp("scheduler")
    with join_scheduler(moto, folder, roles, scheduler_audience(env), mutual_tls=True) as service:
        assert isinstance(service, MutualTlsService)
        yield service


def pool_certificate(scheduler: MutualTlsService) -> dict[str, str]:
    """The pool's certificate secret (JSON by file name), from the scheduler's CA: what a node presents to join."""
    return {name: (scheduler.tls_dir / name).read_text() for name in TLS_FILES}


@pytest.fixture(scope="session")
def local_config() -> NodeConfig:
    """node.json of a decode node of the local environment's dc2, as its user data writes it (moto's URL aside)."""
    env = load_environment(STACKS, "local")
    return node_config(env.stack("local-dc2").config, env.control.config, "decode", "http://moto.invalid")


def model_release() -> ModelRelease:
    files = tuple(
        ModelFile(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for path, data in MODEL_FILES.items()
    )
    return ModelRelease(name="pdstack-tiny", revision="0123abc", prefix="models/pdstack-tiny/0123abc/", files=files)


@pytest.fixture(scope="session")
def image(moto: str) -> str:
    """An AMI moto knows (looked up once: listing them takes most of a second)."""
    return str(client(moto, "ec2").describe_images(MaxResults=5)["Images"][0]["ImageId"])


_NODES = itertools.count()


@pytest.fixture
def node(moto: str, image: str, local_config: NodeConfig, scheduler: MutualTlsService, tmp_path: Path) -> Node:
    """A node of its own: the shared moto server holds every test's resources side by side, each named with the
    test's own suffix (no reset between tests: EC2's first use after one costs a second)."""
    n = next(_NODES)
    config = local_config.model_copy(
        update={
            "aws_endpoint_url": moto,
            "model_dir": str(tmp_path / "model"),
            "release_parameter": f"{local_config.release_parameter}-{n}",
            "secrets": {name: f"{secret}-{n}" for name, secret in local_config.secrets.items()},
            "tls_secret": f"{local_config.tls_secret}-{n}",
        }
    )
    bucket = f"pdstack-local-{config.datacenter}-123456789012-{n}"
    record = ReleaseRecord(
        environment=config.environment,
        release="2026-12-06.1",
        images={"decode": f"123456789012.dkr.ecr.{config.control_region}.amazonaws.com/pdstack-local/decode@{DIGEST}"},
        model=model_release(),
        bundle=NodeBundle(key="bundles/2026-12-06.1.tar.gz", sha256=hashlib.sha256(BUNDLE).hexdigest()),
        buckets={config.datacenter: bucket},
    )
    paths = NodePaths(
        secrets_dir=tmp_path / "run" / "secrets",
        registry_auth_file=tmp_path / "containers" / "auth.json",
        textfile_dir=tmp_path / "node-exporter",
        state_dir=tmp_path / "state",
    )
    seeded = Node(moto, config, record, "", "", bucket, paths)
    s3 = seeded.client("s3")
    s3.create_bucket(Bucket=bucket)  # us-east-1: no location constraint
    for path, data in MODEL_FILES.items():
        s3.put_object(Bucket=bucket, Key=record.model.prefix + path, Body=data)
    s3.put_object(Bucket=bucket, Key=record.bundle.key, Body=BUNDLE)
    secrets = seeded.client("secretsmanager", config.control_region)
    for name, secret_id in config.secrets.items():
        secrets.create_secret(Name=secret_id, SecretString=f"value of {name}")
    secrets.create_secret(Name=config.tls_secret, SecretString=json.dumps(pool_certificate(scheduler)))
    seeded.publish(record)
    # the scheduler's URL, as the control plane writes it (each node again: another test of the folder may write
    # another URL to the same moto)
    seeded.client("ssm", config.control_region).put_parameter(
        Name=scheduler_url_parameter(str(config.environment)), Value=scheduler.url, Type="String", Overwrite=True
    )
    ec2, autoscaling = seeded.client("ec2"), seeded.client("autoscaling")
    template = f"pool-template-{n}"
    ec2.create_launch_template(
        LaunchTemplateName=template, LaunchTemplateData={"ImageId": image, "InstanceType": "t3.micro"}
    )
    seeded.group = f"{config.datacenter}-{config.pool}-{n}"
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=seeded.group,
        MinSize=1,
        MaxSize=2,
        DesiredCapacity=1,
        LaunchTemplate={"LaunchTemplateName": template},
        AvailabilityZones=[f"{config.aws_region}a"],
    )
    group = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[seeded.group])["AutoScalingGroups"][0]
    seeded.instance_id = group["Instances"][0]["InstanceId"]
    role = node_role_name(str(config.environment), config.datacenter, config.pool)
    seeded.credentials = assume(seeded.client("sts", config.control_region), role, seeded.instance_id)
    seeded.scheduler = scheduler
    return seeded
