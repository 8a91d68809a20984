"""The local environment's AWS APIs: moto in server mode, run by us on the host's service address.

A node launched from its pool's user data (pdstack/node) talks to it as a cloud node talks to AWS (node.json's
`aws_endpoint_url`): its release record and the scheduler's URL in SSM, its bundle and model in its datacenter's S3
bucket, its secrets in Secrets Manager, its identity through STS (the scheduler replays the node's signed
GetCallerIdentity here), its registry login from ECR's token API. It runs without a daemon manager, like the
registry (pdstack.local.registry): one background process, its pid and log under the environment's state folder.

moto keeps everything in memory, so a restarted server is empty: `up` seeds it every time, and every function here
is idempotent (it creates what is missing, updates what differs, and leaves the rest alone).

    aws = LocalAws(state_dir); aws.start()
    ensure_node_roles(aws.client("iam"), "local", pools)
    seed_secrets(aws.client("secretsmanager"), "local", values)
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import httpx
from botocore.exceptions import ClientError  # type: ignore[import-untyped]

from pdstack.contract.components import (
    LOCAL_AWS_REGION,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    Component,
    contract,
    scheduler_audience,
    scheduler_url_parameter,
    secret_name,
    setting,
)
from pdstack.contract.node_lifecycle import (
    DRAIN_DEFAULT_RESULT,
    DRAIN_HOOK,
    DRAIN_TRANSITION,
    node_group_name,
    node_role_arn,
    node_role_name,
)
from pdstack.local.names import NAMES, service_name
from pdstack.local.secrets import LocalSecrets
from pdstack.local.tls import Leaf, LocalCA
from pdstack.local.topology import SERVICE_ADDRESS, Topology
from pdstack.local.transport import local_ca
from pdstack.model import PoolRole
from pdstack.node.publish import Published, gpu_datacenters, model_bucket, publish
from pdstack.stacks.environment import EnvironmentStacks

PORT = 5001
ACCOUNT = "123456789012"  # moto's account: every ARN and bucket name of the local environment carries it
REGION = LOCAL_AWS_REGION
# The host's own calls (seeding, publishing): moto takes any key; a node signs with its role's session instead.
HOST_CREDENTIALS = {"aws_access_key_id": "pdstack-local", "aws_secret_access_key": "pdstack-local"}
# What a node role trusts, as infra/node_pool.py's: EC2, for the instance profile.
EC2_TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}],
}
SESSION_S = 12 * 3600  # an instance profile's credentials are refreshed well within this; a local node's are not
# The stack secrets a node may read (contract(serving).node_secrets()), by the LocalSecrets file holding each value.
LOCAL_SECRET_FILES = {
    "gateway-api-keys": "api_keys",
    "kv-channel-key": "kv_channel_key",
    "scheduler-admin-token": "scheduler_admin_token",
    "scheduler-identity-key": "scheduler_identity_key",
    "server-api-token": "server_api_token",
    "ratelimit-store-password": "ratelimit_store_password",
    "metrics-scrape-token": "metrics_scrape_token",
}
Pool = tuple[str, str]  # (datacenter, pool)
# A local group's launch template: moto's EC2 runs no machine, it hands out instance ids (the local nodes take them)
GROUP_IMAGE = "ami-00000000000000000"
GROUP_INSTANCE_TYPE = "t3.micro"
GROUP_ZONE = f"{REGION}a"
GROUP_MAX_SIZE = 20


class LocalAwsError(RuntimeError):
    """The local AWS did not start."""


class LocalAws:
    def __init__(self, state_dir: Path, address: str = str(SERVICE_ADDRESS), port: int = PORT) -> None:
        self.state_dir = state_dir
        self.address = address
        self.port = port

    @property
    def endpoint(self) -> str:
        """What node.json's `aws_endpoint_url` names: http://10.210.255.1:5001."""
        return f"http://{self.address}:{self.port}"

    @property
    def _pid_file(self) -> Path:
        return self.state_dir / "aws.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "aws.log"

    def pid(self) -> int | None:
        if not self._pid_file.is_file():
            return None
        pid = int(self._pid_file.read_text())
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.endpoint}/moto-api/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> None:
        if self.pid() is not None and self.healthy():
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "moto.server", "-H", self.address, "-p", str(self.port)]
        with self.log_file.open("a") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._pid_file.write_text(str(process.pid))
        deadline = time.monotonic() + 30
        while not self.healthy():
            if process.poll() is not None or time.monotonic() > deadline:
                raise LocalAwsError(f"the local AWS (moto) did not start; see {self.log_file}")
            time.sleep(0.2)

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while self.pid() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
        self._pid_file.unlink(missing_ok=True)

    def client(self, service: str, region: str = REGION) -> Any:
        """A boto3 client of `service` in `region`, on the host's credentials."""
        return boto3.client(service, region_name=region, endpoint_url=self.endpoint, **HOST_CREDENTIALS)

    def clients(self, service: str, region: str) -> Any:
        """pdstack.node.publish's ClientFactory."""
        return self.client(service, region)

    def registry_credentials(self) -> tuple[str, str]:
        """(user, password) of ECR's token in the control region, decoded as the node decodes it
        (pdstack.node.registry): what the local registry must accept (pdstack.local.registry.Registry)."""
        data = self.client("ecr").get_authorization_token()["authorizationData"][0]
        user, _, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
        return user, password


def local_secret_values(secrets: LocalSecrets, names: Iterable[str]) -> dict[str, str]:
    """Each stack secret in `names` (contract(serving).node_secrets()) -> its value from the local secrets' files."""
    unknown = sorted(set(names) - set(LOCAL_SECRET_FILES))
    if unknown:
        raise ValueError(f"no local file for the stack secrets {', '.join(unknown)}")
    return {name: Path(getattr(secrets, LOCAL_SECRET_FILES[name])).read_text() for name in names}


def pool_leaf(datacenter: str, pool: str, addresses: Sequence[str]) -> Leaf:
    """A GPU pool's certificate, shared by every node of the pool as the cloud's (infra/program.py): the pool's name
    and the wildcard its nodes' own names fall in, plus `addresses`, every address a node of the pool may have (the
    local servers register and are reached by address, and their callers check it)."""
    return Leaf(
        f"pool-{datacenter}-{pool}", (NAMES.host(pool, datacenter), NAMES.instances(pool, datacenter)), (*addresses,)
    )


def pool_tls_values(ca: LocalCA, pools: Mapping[Pool, Sequence[str]]) -> dict[str, str]:
    """Each pool's certificate (issued by the local CA when missing, stale or its addresses changed) as the secret
    a node reads: `tls/<datacenter>/<pool>` (seed_secrets names it tls_secret_name) -> JSON by TLS_*_FILE name."""
    leaves = {(dc, pool): pool_leaf(dc, pool, addresses) for (dc, pool), addresses in pools.items()}
    ca.ensure(list(leaves.values()))
    values = {}
    for (dc, pool), leaf in sorted(leaves.items()):
        files = {
            TLS_CERT_FILE: ca.cert(leaf.name).read_text(),
            TLS_KEY_FILE: ca.key(leaf.name).read_text(),
            TLS_CA_FILE: ca.ca_cert.read_text(),
        }
        values[f"tls/{dc}/{pool}"] = json.dumps(files, sort_keys=True)
    return values


def seed_secrets(secretsmanager: Any, env: str, values: Mapping[str, str]) -> list[str]:
    """Each value as the Secrets Manager secret secret_name(env, name), created or updated; the names written."""
    written = []
    for name, value in sorted(values.items()):
        secret_id = secret_name(env, name)
        try:
            secretsmanager.create_secret(Name=secret_id, SecretString=value)
        except secretsmanager.exceptions.ResourceExistsException:
            if secretsmanager.get_secret_value(SecretId=secret_id).get("SecretString") == value:
                continue
            secretsmanager.put_secret_value(SecretId=secret_id, SecretString=value)
        written.append(secret_id)
    return written


def seed_scheduler_url(ssm: Any, env: str, url: str) -> bool:
    """The scheduler's URL where a joining node reads it (pdstack.node.join); True when it changed."""
    parameter = scheduler_url_parameter(env)
    try:
        if ssm.get_parameter(Name=parameter)["Parameter"]["Value"] == url:
            return False
    except ssm.exceptions.ParameterNotFound:
        pass
    ssm.put_parameter(Name=parameter, Value=url, Type="String", Overwrite=True)
    return True


def ensure_buckets(s3: Any, env: str, datacenters: Iterable[str], account: str = ACCOUNT) -> dict[str, str]:
    """Each GPU datacenter's model bucket (made when missing); datacenter -> bucket, as publish takes them."""
    buckets = {dc: model_bucket(env, dc, account) for dc in sorted(datacenters)}
    for bucket in buckets.values():
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=bucket)  # us-east-1: no LocationConstraint
    return buckets


def ensure_node_roles(iam: Any, env: str, pools: Iterable[Pool], account: str = ACCOUNT) -> dict[Pool, str]:
    """Each GPU pool's instance role (made when missing), trusting EC2; (datacenter, pool) -> its ARN (what the
    scheduler's join_node_roles names)."""
    arns = {}
    for dc, pool in sorted(pools):
        with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
            iam.create_role(
                RoleName=node_role_name(env, dc, pool),
                AssumeRolePolicyDocument=json.dumps(EC2_TRUST),
                MaxSessionDuration=SESSION_S,
            )
        arns[(dc, pool)] = node_role_arn(account, env, dc, pool)
    return arns


def ensure_groups(
    autoscaling: Any,
    ec2: Any,
    env: str,
    desired: Mapping[Pool, int],
    *,
    heartbeat_timeout: int,
    max_size: int = GROUP_MAX_SIZE,
) -> dict[Pool, list[str]]:
    """Each GPU pool's Auto Scaling group node_group_name(env, dc, pool) at its desired capacity, with the drain hook
    (DRAIN_HOOK, `heartbeat_timeout`: drain_timeout_seconds(serving)); (datacenter, pool) -> its InService instance
    ids, sorted. moto's EC2 runs nothing: these ids are what the local nodes must boot as (their instance id), so a
    node's SetInstanceHealth (pdstack.node.loader.report_failure) finds its group. moto 5.2.5 answers neither
    CompleteLifecycleAction nor RecordLifecycleActionHeartbeat (HTTP 500), and a scale-in removes instances at once
    (no Terminating:Wait): the hook is there for the name, not for a drain."""
    out = {}
    for (dc, pool), capacity in sorted(desired.items()):
        group = node_group_name(env, dc, pool)
        try:
            ec2.create_launch_template(
                LaunchTemplateName=group,
                LaunchTemplateData={"ImageId": GROUP_IMAGE, "InstanceType": GROUP_INSTANCE_TYPE},
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "InvalidLaunchTemplateName.AlreadyExistsException":
                raise
        sizes = {"MinSize": 0, "MaxSize": max(max_size, capacity), "DesiredCapacity": capacity}
        if autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"]:
            autoscaling.update_auto_scaling_group(AutoScalingGroupName=group, **sizes)
        else:
            autoscaling.create_auto_scaling_group(
                AutoScalingGroupName=group,
                LaunchTemplate={"LaunchTemplateName": group, "Version": "$Latest"},
                AvailabilityZones=[GROUP_ZONE],
                **sizes,
            )
        autoscaling.put_lifecycle_hook(
            AutoScalingGroupName=group,
            LifecycleHookName=DRAIN_HOOK,
            LifecycleTransition=DRAIN_TRANSITION,
            HeartbeatTimeout=heartbeat_timeout,
            DefaultResult=DRAIN_DEFAULT_RESULT,
        )
        found = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"][0]
        out[(dc, pool)] = sorted(i["InstanceId"] for i in found["Instances"] if i["LifecycleState"] == "InService")
    return out


def node_credentials(sts: Any, role_arn: str, instance_id: str) -> dict[str, str]:
    """An instance's role credentials, as its instance profile hands them out: the role's session named after the
    instance (GetCallerIdentity answers arn:aws:sts::<account>:assumed-role/<role>/<instance id>). Keyed as boto3's
    client arguments (and a shared credentials file's profile)."""
    found = sts.assume_role(RoleArn=role_arn, RoleSessionName=instance_id, DurationSeconds=SESSION_S)["Credentials"]
    return {
        "aws_access_key_id": found["AccessKeyId"],
        "aws_secret_access_key": found["SecretAccessKey"],
        "aws_session_token": found["SessionToken"],
    }


def publish_local_release(
    aws: LocalAws,
    env: EnvironmentStacks,
    *,
    release: str,
    bundle: Path,
    model_dir: Path,
    model_name: str,
    model_revision: str,
    images: Mapping[str, str],
    account: str = ACCOUNT,
) -> Published:
    """pdstack.node.publish.publish against the local AWS, into the buckets ensure_buckets made."""
    buckets = {dc: model_bucket(env.name, dc, account) for dc in gpu_datacenters(env)}
    return publish(
        env,
        release=release,
        bundle=bundle,
        model_dir=model_dir,
        model_name=model_name,
        model_revision=model_revision,
        images=images,
        buckets=buckets,
        clients=aws.clients,
    )


def gpu_pools(topology: Topology) -> list[Pool]:
    return [(dc.name, pool) for dc in topology.datacenters for pool, role in dc.pools if role is not PoolRole.CONTROL]


def seed_local_aws(aws: LocalAws, topology: Topology, secrets: LocalSecrets, state_dir: Path) -> dict[str, str]:
    """Everything a node booting from user data reads before the release (`up`, every time: moto forgets): the node
    secrets and each pool's certificate (every address the pool's nodes may have), the scheduler's URL, the model
    buckets and the node roles. Returns the scheduler's join settings for those roles."""
    env = "local"
    pools = gpu_pools(topology)
    served = contract(topology.serving)
    values = local_secret_values(secrets, served.node_secrets())
    addresses = {(dc, pool): topology.pool_addresses(dc, pool) for dc, pool in pools}
    values |= pool_tls_values(local_ca(state_dir), addresses)
    seed_secrets(aws.client("secretsmanager"), env, values)
    scheduler = f"https://{service_name(topology, 'scheduler')}:{served[Component.SCHEDULER].port}"
    seed_scheduler_url(aws.client("ssm"), env, scheduler)
    ensure_buckets(aws.client("s3"), env, sorted({dc for dc, _ in pools}))
    roles = ensure_node_roles(aws.client("iam"), env, pools)
    components = {(dc, pool): str(topology.datacenter(dc).pool_role(pool)) for dc, pool in pools}
    return scheduler_join_env({arn: components[pool] for pool, arn in roles.items()}, aws.endpoint)


def scheduler_join_env(node_roles: Mapping[str, str], aws_endpoint: str) -> dict[str, str]:
    """The scheduler's join settings for the local nodes (pdserve.scheduler.join; the cloud's are infra's
    scheduler_join_settings): each node role's ARN -> its component, the environment's audience, STS at the local
    AWS."""
    return {
        setting("join_node_roles"): ",".join(f"{arn}={component}" for arn, component in sorted(node_roles.items())),
        setting("join_audience"): scheduler_audience("local"),
        setting("join_sts_url"): aws_endpoint + "/",
    }
