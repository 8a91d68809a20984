"""The local GPU pools' Auto Scaling groups, on the cloud's path: `pdstack local up` boots every GPU node through them
(up_pools), `pdstack local scale DATACENTER POOL N` adds and removes nodes (scale).

Scale-out (and each node `up` boots): the pool's group (in the local AWS) hands out an instance id per node to add; each
node boots as a node container from its pool's user data, the very text of the launch template (pdstack.node.userdata,
the local AWS endpoint in node.json), through cloud-init's NoCloud seed, its instance role's credentials as the
platform's vendor data. From there the node does it all itself, as a cloud node does: the release record, the bundle,
secrets, joining the scheduler, the registry's login, the model from the bucket, the roles applied to itself
(pdstack/node).

Scale-in: the newest node the group launched goes first. It drains on the node itself (`pdstack node drain`: no new
requests, in-flight ones and KV leases finish, deregistered, stopped), then its group terminates it and the
container goes. In the cloud the same drain is triggered by the group's lifecycle hook (pdstack.node.drain); the
local platform has no metadata service to carry the hook, so it asks the node directly.

The release the nodes boot into, by its version (what the scheduler's weights route to): its images by digest, the
node bundle of this checkout and the model, published to the local AWS (pdstack.node.publish) when any of them
changed. `up` publishes the release it built (release.json) and replaces, through the drain, a node running another;
`scale` boots into the one the pool's servers run now (up's, or the canary deploy.yml promoted last).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
from pdstack.local.converged import inputs_digest
from pdstack.local.engine_choice import bundle_values
from pdstack.local.inventory import write_inventory
from pdstack.local.model import MANIFEST
from pdstack.local.pools import CapacityError, checked_capacity, load_capacity, save_capacity
from pdstack.local.topology import Node, Topology, load_topology
from pdstack.local.transport import ensure_certificates, local_ca
from pdstack.model import Environment, PoolRole
from pdstack.node.bundle import Bundle, build_bundle, bundle_sources
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
# Each poll of a booting node is a `podman exec` (cloud-init's status a Python start in the node): four nodes polled
# every second or two took about a core-minute of their own boot
POLL_S = 5.0


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
class Published:
    name: str  # the release's version
    bundle_sha256: str


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
            f"desired: {datacenter}/{pool}'s first {len(stack_nodes)} nodes are the stack's desired_size, which "
            f"`up` keeps; scale-in here removes only the nodes the group launched beyond it"
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
        remove_instance(env, aws, before, node)
        report.removed.append(node.name)
    save_capacity(env.capacity_file, capacity)
    # The operators' plays reach the nodes the group launched: listed, and with a certificate of the local CA for
    # its serving_node to hand over (as a cloud node's own name is on its pool's certificate in Secrets Manager)
    write_inventory(after, env.inventory)
    ensure_certificates(after, env.state_dir)
    for node in [n for n in after.pool_nodes(datacenter, pool) if nodes.node_exists(n.name)]:
        if _unit_state(node.name) == "failed":  # it marked itself Unhealthy: the group replaces it
            say(f"scale: {node.name}'s bootstrap failed: replacing it")
            remove_instance(env, aws, after, node, drain=False)
    wanted = [n for n in after.pool_nodes(datacenter, pool) if not nodes.node_exists(n.name)]
    if not wanted:
        return report
    published = publish_release(env, aws, fleet_release(env, before, wanted[0].role), say)
    launched = boot_and_wait(env, aws, after, wanted, say)
    return ScaleReport(datacenter, pool, desired, published.name, launched, report.removed)


def up_pools(
    env: LocalEnv, aws: LocalAws, topology: Topology, say: Callable[[str], None], stop: threading.Event | None = None
) -> list[Launched]:
    """`up`'s GPU nodes: every node of every GPU pool runs the release `up` built, booted from its pool's user data.
    A node that runs it already (its bootstrap done, the release's version served, its bundle installed) stays; one
    on another release, or whose bootstrap failed, is drained and replaced; the missing ones boot side by side.
    `stop` set (the control plane's converge failed) ends the wait."""
    published = publish_release(env, aws, deployed_release(env), say)
    stale = [
        n for n in topology.nodes if n.boots_from_user_data and nodes.node_exists(n.name) and not _runs(n, published)
    ]
    active = [n for n in stale if _unit_state(n.name) == "active"]
    for node in stale:
        how = "draining" if node in active else "removing"
        say(f"nodes: {node.name} does not run release {published.name}: {how} it")
    with ThreadPoolExecutor(max_workers=max(1, len(active))) as draining:  # side by side, as a first install does
        list(draining.map(drain_on_node, active))
    for node in stale:
        remove_instance(env, aws, topology, node, drain=False)
    if stale:  # what the removal took with it
        ensure_certificates(topology, env.state_dir)
    wanted = [n for n in topology.nodes if n.boots_from_user_data and not nodes.node_exists(n.name)]
    if not wanted:
        say(f"nodes: every GPU node runs release {published.name} (booted from its pool's user data)")
        return []
    return boot_and_wait(env, aws, topology, wanted, say, stop=stop)


def boot_and_wait(
    env: LocalEnv,
    aws: LocalAws,
    topology: Topology,
    wanted: list[Node],
    say: Callable[[str], None],
    *,
    stop: threading.Event | None = None,
) -> list[Launched]:
    """Boot `wanted` as instances of their pools' groups, then wait for them side by side; ScaleError naming every
    node that did not come up."""
    ids: dict[str, str] = {}
    for datacenter, pool in sorted({(n.datacenter, n.pool) for n in wanted}):
        ids |= instance_ids(env, aws, topology, datacenter, pool)
    env.network(topology).up()
    for node in wanted:
        say(f"nodes: {node.name} boots as {ids[node.name]} from {node.datacenter}/{node.pool}'s user data")
        boot(env, aws, topology, node, ids[node.name])
    with ThreadPoolExecutor(max_workers=len(wanted)) as waiting:
        futures = [waiting.submit(wait_ready, node, ids[node.name], say, stop=stop) for node in wanted]
    failed = [str(f.exception()) for f in futures if f.exception() is not None]
    if failed:
        raise ScaleError("\n\n".join(failed))
    return [f.result() for f in futures]


# -- the release --------------------------------------------------------------------------------------------------
def publish_release(env: LocalEnv, aws: LocalAws, running: dict[str, Any], say: Callable[[str], None]) -> Published:
    """`running` ({version, image[, vllm_image]}) as a record nodes boot into, named by its version: the version the
    scheduler's weights route to (a node of another name would be ready and get no traffic). Published again when
    it, this checkout's bundle, the images or the model changed."""
    deployed = json.loads(env.release_file.read_text())
    name = str(running["version"])
    images = {"prefill": running["image"], "decode": running["image"]}
    if "vllm_image" in running:
        images["vllm"] = running["vllm_image"]
    model = Path(deployed["pdstack_model"]["source"])
    revision = hashlib.sha256((model / MANIFEST).read_bytes()).hexdigest()[:12]
    bundle = node_bundle(env, bundle_values(deployed), say)
    try:
        current = read_release(aws.client("ssm"), ENV)
        if (current.release, current.bundle.sha256, current.images, current.model.revision) == (
            name,
            bundle.sha256,
            images,
            revision,
        ):
            return Published(name, bundle.sha256)
    except ReleaseNotFoundError:
        pass
    say(f"release: publishing {name} (bundle, model, images) to the local AWS")
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
    return Published(name, bundle.sha256)


def node_bundle(env: LocalEnv, rendered: dict[str, str], say: Callable[[str], None]) -> Bundle:
    """This checkout's node bundle (pdstack node bundle --env local), built again only when what it is built from
    (pdstack.node.bundle.bundle_sources, the rendered values) changed since the last one."""
    folder = env.state_dir / "bundle"
    key = inputs_digest(env.project, bundle_sources(env.project)) + json.dumps(rendered, sort_keys=True)
    stamp = folder / "built-from.json"
    if stamp.is_file():
        last = json.loads(stamp.read_text())
        built = Bundle(Path(last["path"]), last["sha256"], last["size"], tuple(last["members"]))
        if last["key"] == key and built.path.is_file() and built.path.stat().st_size == built.size:
            say(f"release: the node bundle of this checkout, unchanged since it was built ({built.sha256[:12]})")
            return built
    say("release: the node bundle of this checkout (pdstack node bundle --env local)")
    built = build_bundle(env.project, ENV, folder, rendered=rendered)
    record = {"key": key, "path": str(built.path), "sha256": built.sha256, "size": built.size}
    stamp.write_text(json.dumps({**record, "members": list(built.members)}) + "\n")
    return built


def deployed_release(env: LocalEnv) -> dict[str, Any]:
    """{version, image[, vllm_image]} of the release `up` built (release.json)."""
    release: dict[str, Any] = json.loads(env.release_file.read_text())["pdstack_release"]
    return {k: release[k] for k in ("version", "image", "vllm_image") if k in release}


def fleet_release(env: LocalEnv, topology: Topology, role: PoolRole) -> dict[str, Any]:
    """{version, image[, vllm_image]} a running server of `role` serves now (up's release, or the last canary
    deploy.yml promoted), from the record its role keeps on the node; up's where none serves yet."""
    for node in [n for n in topology.nodes_with_role(role) if nodes.node_exists(n.name)]:
        current: dict[str, Any] | None = _server_record(node).get("current")
        if current is not None:
            return current
    return deployed_release(env)


def _server_record(node: Node) -> dict[str, Any]:
    """The record the serving role keeps on the node (serving_node's record.yml, under pdserve_state_dir /
    vllm_engine_state_dir); {} where there is none."""
    path = f"{SERVER_STATE_DIR}/{node.role}.release.json"
    found = run_captured(["podman", "exec", node.name, "cat", path], check=False)
    record: dict[str, Any] = json.loads(found.stdout) if found.returncode == 0 else {}
    return record


def _runs(node: Node, published: Published) -> bool:
    """Whether the node's bootstrap is done and it serves `published`: the release's version, from its bundle."""
    if _unit_state(node.name) != "active":
        return False
    venv = run_captured(["podman", "exec", node.name, "readlink", str(STATE_DIR / CURRENT_VENV)], check=False)
    version = _server_record(node).get("current", {}).get("version")
    return version == published.name and venv.stdout.strip().endswith(f"/{published.bundle_sha256}")


# -- instances ----------------------------------------------------------------------------------------------------
def instance_ids(env: LocalEnv, aws: LocalAws, topology: Topology, datacenter: str, pool: str) -> dict[str, str]:
    """node name -> the instance id the pool's group gave it (kept across runs in instances.json)."""
    members = topology.pool_nodes(datacenter, pool)
    given = _instances(env)
    groups = ensure_groups(
        aws.client("autoscaling"),
        aws.client("ec2"),
        ENV,
        {(datacenter, pool): len(members)},
        heartbeat_timeout=drain_timeout_seconds(topology.serving),
    )
    free = [i for i in groups[(datacenter, pool)] if i not in given.values()]
    for node in members:
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


def wait_ready(
    node: Node,
    instance_id: str,
    say: Callable[[str], None],
    timeout: float = nodes.BOOT_TIMEOUT_S,
    stop: threading.Event | None = None,
) -> Launched:
    """Until the node's bootstrap unit finished: its seconds from launch, by phase; ScaleError with its log when it
    failed (the node marked itself Unhealthy in its group, as a cloud node does), or when `stop` is set."""
    started = time.monotonic()
    wait_for_cloud_init(node.name, timeout=timeout, interval=POLL_S)
    booted = time.monotonic() - started
    deadline = started + timeout
    state = _unit_state(node.name)
    while state in PENDING and time.monotonic() < deadline:
        if (not state and not nodes.node_running(node.name)) or (stop is not None and stop.is_set()):
            break
        time.sleep(POLL_S)
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
        f"nodes: {node.name} ready in {seconds['total']:.0f}s: "
        + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
        + f"; apply: {', '.join(f'{k} {v:.1f}s' for k, v in apply.items())}; model {model_bytes} bytes downloaded"
    )
    return Launched(node.name, instance_id, seconds, apply, model_bytes)


def remove_instance(env: LocalEnv, aws: LocalAws, topology: Topology, node: Node, *, drain: bool = True) -> None:
    """Drain on the node (unless it never came up), terminate its instance in the group, remove the container and
    its network namespace."""
    if drain and nodes.node_exists(node.name):
        drain_on_node(node)
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


def drain_on_node(node: Node) -> None:
    """`pdstack node drain` on the node: no new requests, in-flight ones and KV leases finish, deregistered, stopped
    (ScaleError with its output when it fails: the node stays)."""
    python = STATE_DIR / CURRENT_VENV / "bin" / "python"
    drained = run_captured(["podman", "exec", node.name, str(python), "-m", "pdstack.node", "drain"], check=False)
    if drained.returncode != 0:
        raise ScaleError(f"{node.name} did not drain; it stays:\n{(drained.stdout + drained.stderr)[-4000:]}")


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
