"""`pdstack local scale DATACENTER POOL N`: the local pools' Auto Scaling groups, on the cloud's path.

Scale-out: the pool's group (in the local AWS) hands out an instance id per node to add; each node boots as a node
container from its pool's user data, the very text of the launch template (pdstack.node.userdata, the local AWS
endpoint in node.json), through cloud-init's NoCloud seed, its instance role's credentials as the platform's vendor
data. From there the node does it all itself, as a cloud node does: the release record, the bundle, secrets, joining
the scheduler, the registry's login, the model from the bucket, the roles applied to itself (pdstack/node).

Scale-in: the newest node the group launched goes first. It drains on the node itself (`pdstack node drain`: no new
requests, in-flight ones and KV leases finish, deregistered, stopped), then its group terminates it and the
container goes. In the cloud the same drain is triggered by the group's lifecycle hook (pdstack.node.drain); the
local platform has no metadata service to carry the hook, so it asks the node directly.

The release the nodes boot into is the one the pool's converged servers run now (`up`'s, or the canary deploy.yml
promoted last), by its version (what the scheduler's weights route to): its images by digest, the node bundle of this
checkout and the model, published to the local AWS (pdstack.node.publish) when any of them changed.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdstack.contract.components import LOCAL_AWS_REGION, NODE_EXPORTER_TEXTFILE_DIR
from pdstack.contract.node_lifecycle import drain_timeout_seconds, node_group_name, node_role_arn
from pdstack.local import nodes
from pdstack.local.aws import ACCOUNT, LocalAws, ensure_groups, node_credentials, publish_local_release
from pdstack.local.cloud_seed import (
    InstanceSeed,
    launch_instance,
    platform_vendor_data,
    wait_for_cloud_init,
    write_seed,
)
from pdstack.local.commands import run_captured
from pdstack.local.engine_choice import bundle_values
from pdstack.local.inventory import write_inventory
from pdstack.local.model import MANIFEST
from pdstack.local.pools import CapacityError, checked_capacity, load_capacity, save_capacity
from pdstack.local.topology import Node, Topology, load_topology
from pdstack.local.transport import ensure_certificates, local_ca
from pdstack.model import Environment
from pdstack.node.bundle import build_bundle
from pdstack.node.loader import CURRENT_VENV, METRICS_FILE, STATE_DIR, read_metrics
from pdstack.node.release import ReleaseNotFoundError, read_release
from pdstack.node.userdata import UNIT, render_user_data
from pdstack.stacks.environment import load_environment

if TYPE_CHECKING:
    from pdstack.local.env import LocalEnv

ENV = str(Environment.LOCAL)
METRICS = f"{NODE_EXPORTER_TEXTFILE_DIR}/{METRICS_FILE}"
SERVER_STATE_DIR = "/var/lib/pdstack/pdserve"  # roles/pdserve's pdserve_state_dir, vllm_engine's default alike
PENDING = {"activating", "inactive", ""}  # the bootstrap unit not finished yet, or its state not read
BOOT_TIMEOUT_S = 1200.0  # packages, a 100 MB bundle, a venv installed offline, the model and the roles on 2 cores


class ScaleError(RuntimeError):
    """A node did not come up (its bootstrap's own message and log tail), or did not drain."""


@dataclass(frozen=True)
class Launched:
    node: str
    instance_id: str
    seconds: dict[str, float]  # boot (to cloud-init done), then each bootstrap phase, then total
    apply: dict[str, float] = field(default_factory=dict)  # the apply phase's image, roles and engine_start
    model_bytes: int = 0  # downloaded from the datacenter's bucket


@dataclass(frozen=True)
class ScaleReport:
    datacenter: str
    pool: str
    desired: int
    release: str = ""
    launched: list[Launched] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def scale(env: LocalEnv, datacenter: str, pool: str, desired: int, say: Callable[[str], None] = print) -> ScaleReport:
    checked_capacity(env.stacks_dir, datacenter, pool, desired)
    before = env.topology()
    stack_nodes = [n for n in before.pool_nodes(datacenter, pool) if not n.launched]
    if desired < len(stack_nodes):
        raise CapacityError(
            f"desired: {datacenter}/{pool}'s first {len(stack_nodes)} nodes are the stack's desired_size, which the "
            f"operators' playbooks converge; scale-in here removes only the nodes the group launched"
        )
    if not env.release_file.is_file():
        raise ScaleError("no release yet: run `pdstack local up` first")
    aws = env.aws()
    aws.start()
    capacity = load_capacity(env.capacity_file) | {(datacenter, pool): desired}
    after = load_topology(env.stacks_dir, capacity)
    kept = {n.name for n in after.nodes}
    report = ScaleReport(datacenter, pool, desired)
    for node in reversed([n for n in before.pool_nodes(datacenter, pool) if n.name not in kept]):
        say(f"scale: draining {node.name}, then removing it")
        remove_launched(env, aws, before, node)
        report.removed.append(node.name)
    save_capacity(env.capacity_file, capacity)
    # The operators' plays reach the nodes the group launched: listed, and with a certificate of the local CA for
    # its serving_node to hand over (as a cloud node's own name is on its pool's certificate in Secrets Manager)
    write_inventory(after, env.inventory)
    ensure_certificates(after, env.state_dir)
    for node in [n for n in after.pool_nodes(datacenter, pool) if n.launched and nodes.node_exists(n.name)]:
        if _unit_state(node.name) == "failed":  # it marked itself Unhealthy: the group replaces it
            say(f"scale: {node.name}'s bootstrap failed: replacing it")
            remove_launched(env, aws, after, node, drain=False)
    wanted = [n for n in after.pool_nodes(datacenter, pool) if n.launched and not nodes.node_exists(n.name)]
    if not wanted:
        return report
    release = publish_release(env, aws, before, str(wanted[0].role), say)
    ids = instance_ids(env, aws, after, datacenter, pool)
    env.network(after).up()
    for node in wanted:
        say(f"scale: {node.name} boots as {ids[node.name]} from {datacenter}/{pool}'s user data")
        boot(env, aws, after, node, ids[node.name])
    for node in wanted:
        report.launched.append(wait_ready(node, ids[node.name], say))
    return ScaleReport(datacenter, pool, desired, release, report.launched, report.removed)


# -- the release --------------------------------------------------------------------------------------------------
def publish_release(env: LocalEnv, aws: LocalAws, topology: Topology, role: str, say: Callable[[str], None]) -> str:
    """The release the pool's servers run now (up's, or the last canary deploy.yml promoted), as a record nodes boot
    into, named by its version: the version the scheduler's weights route to (a node of another name would be ready
    and get no traffic). Published again when it, this checkout's bundle, the images or the model changed."""
    deployed = json.loads(env.release_file.read_text())
    running = serving_release(topology, role)
    name = str(running["version"])
    images = {"prefill": running["image"], "decode": running["image"]}
    if "vllm_image" in running:
        images["vllm"] = running["vllm_image"]
    model = Path(deployed["pdstack_model"]["source"])
    revision = hashlib.sha256((model / MANIFEST).read_bytes()).hexdigest()[:12]
    say("scale: the node bundle of this checkout (pdstack node bundle --env local)")
    bundle = build_bundle(env.project, ENV, env.state_dir / "bundle", rendered=bundle_values(deployed))
    try:
        current = read_release(aws.client("ssm"), ENV)
        if (current.release, current.bundle.sha256, current.images, current.model.revision) == (
            name,
            bundle.sha256,
            images,
            revision,
        ):
            return name
    except ReleaseNotFoundError:
        pass
    say(f"scale: publishing release {name} (bundle, model, images) to the local AWS")
    publish_local_release(
        aws,
        load_environment(env.stacks_dir, ENV),
        release=name,
        bundle=bundle.path,
        model_dir=model,
        model_name=deployed["pdstack_model"]["name"],
        model_revision=revision,
        images=images,
    )
    return name


def serving_release(topology: Topology, role: str) -> dict[str, Any]:
    """{version, image[, vllm_image]} a converged server of `role` runs now: the record its role keeps on the node
    (serving_node's record.yml, under pdserve_state_dir / vllm_engine_state_dir)."""
    node = next(n for n in topology.converged_nodes if str(n.role) == role)
    record = nodes.exec_in_node(node.name, ["cat", f"{SERVER_STATE_DIR}/{role}.release.json"])
    current: dict[str, Any] = json.loads(record)["current"]
    return current


# -- instances ----------------------------------------------------------------------------------------------------
def instance_ids(env: LocalEnv, aws: LocalAws, topology: Topology, datacenter: str, pool: str) -> dict[str, str]:
    """node name -> the instance id the pool's group gave it (kept across runs in instances.json)."""
    launched = [n for n in topology.pool_nodes(datacenter, pool) if n.launched]
    given = _instances(env)
    groups = ensure_groups(
        aws.client("autoscaling"),
        aws.client("ec2"),
        ENV,
        {(datacenter, pool): len(launched)},
        heartbeat_timeout=drain_timeout_seconds(topology.serving),
    )
    free = [i for i in groups[(datacenter, pool)] if i not in given.values()]
    for node in launched:
        if given.get(node.name) not in groups[(datacenter, pool)]:
            given[node.name] = free.pop(0)
    _save_instances(env, given)
    return given


def boot(env: LocalEnv, aws: LocalAws, topology: Topology, node: Node, instance_id: str) -> None:
    stacks = load_environment(env.stacks_dir, ENV)
    stack = next(s for s in stacks.stacks if s.config.datacenter.name == node.datacenter)
    user_data = render_user_data(stack.config, stacks.control.config, node.pool, aws_endpoint_url=aws.endpoint)
    role = node_role_arn(ACCOUNT, ENV, node.datacenter, node.pool)
    keys = node_credentials(aws.client("sts"), role, instance_id)
    operator_key = nodes.ensure_ssh_key(env.ssh_key).with_suffix(".pub").read_text()
    vendor = platform_vendor_data(
        keys["aws_access_key_id"],
        keys["aws_secret_access_key"],
        keys["aws_session_token"],
        LOCAL_AWS_REGION,
        operator_key,
    )
    seed = write_seed(InstanceSeed(instance_id, node.name, user_data, vendor), env.state_dir / "seeds" / node.name)
    launch_instance(nodes.NodeSpec(node.name, extra_args=("--network", f"ns:/run/netns/{node.namespace}")), seed)


def wait_ready(node: Node, instance_id: str, say: Callable[[str], None], timeout: float = BOOT_TIMEOUT_S) -> Launched:
    """Until the node's bootstrap unit finished: its seconds from launch, by phase; ScaleError with its log when it
    failed (the node marked itself Unhealthy in its group, as a cloud node does)."""
    started = time.monotonic()
    wait_for_cloud_init(node.name, timeout=timeout)
    booted = time.monotonic() - started
    deadline = started + timeout
    state = _unit_state(node.name)
    while state in PENDING and time.monotonic() < deadline:
        if not state and not nodes.node_running(node.name):
            break
        time.sleep(2)
        state = _unit_state(node.name)
    if state != "active":
        log = run_captured(
            ["podman", "exec", node.name, "journalctl", "-u", UNIT, "-n", "40", "--no-pager"], check=False
        )
        raise ScaleError(f"{node.name} ({instance_id}) did not come up: {UNIT} is {state}\n{log.stdout[-4000:]}")
    metrics = _bootstrap_metrics(node.name)
    seconds = {"boot": booted, **metrics["phase_seconds"], "total": time.monotonic() - started}
    apply, model_bytes = metrics["apply_seconds"], int(metrics["model_downloaded_bytes"].get("", 0))
    say(
        f"scale: {node.name} ready in {seconds['total']:.0f}s: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
        + f"; apply: {', '.join(f'{k} {v:.1f}s' for k, v in apply.items())}; model {model_bytes} bytes downloaded"
    )
    return Launched(node.name, instance_id, seconds, apply, model_bytes)


def remove_launched(env: LocalEnv, aws: LocalAws, topology: Topology, node: Node, *, drain: bool = True) -> None:
    """Drain on the node (unless it never came up), terminate its instance in the group, remove the container and
    its network namespace."""
    if drain and nodes.node_exists(node.name):
        python = STATE_DIR / CURRENT_VENV / "bin" / "python"
        drained = run_captured(["podman", "exec", node.name, str(python), "-m", "pdstack.node", "drain"], check=False)
        if drained.returncode != 0:
            raise ScaleError(f"{node.name} did not drain; it stays:\n{(drained.stdout + drained.stderr)[-4000:]}")
    given = _instances(env)
    if node.name in given:
        group = node_group_name(ENV, node.datacenter, node.pool)
        asg = aws.client("autoscaling")
        if _in_group(asg, group, given[node.name]):
            asg.terminate_instance_in_auto_scaling_group(
                InstanceId=given[node.name], ShouldDecrementDesiredCapacity=True
            )
        del given[node.name]
        _save_instances(env, given)
    nodes.remove_node(node.name)
    env.network(topology).remove_node(node)
    local_ca(env.state_dir).forget(node.name)


def _in_group(asg: Any, group: str, instance_id: str) -> bool:
    found = asg.describe_auto_scaling_instances(InstanceIds=[instance_id])["AutoScalingInstances"]
    return any(i["AutoScalingGroupName"] == group for i in found)


def _unit_state(name: str) -> str:
    """systemctl's word for the bootstrap unit; empty when the exec itself failed (a busy machine: CI saw it end a
    wait on a node that went on to come up), which the caller tells from a node that stopped."""
    return run_captured(["podman", "exec", name, "systemctl", "is-active", UNIT], check=False).stdout.strip()


def _bootstrap_metrics(name: str) -> dict[str, dict[str, float]]:
    """The node's bootstrap metrics (pdstack.node.loader.read_metrics), every family present, empty or not."""
    text = run_captured(["podman", "exec", name, "cat", METRICS], check=False).stdout
    families = ("phase_seconds", "apply_seconds", "model_downloaded_bytes")
    return {family: {} for family in families} | read_metrics(text)


def _instances(env: LocalEnv) -> dict[str, str]:
    path = env.state_dir / "instances.json"
    return dict(json.loads(path.read_text())) if path.is_file() else {}


def _save_instances(env: LocalEnv, given: dict[str, str]) -> None:
    (env.state_dir / "instances.json").write_text(json.dumps(given, indent=2, sort_keys=True) + "\n")
