"""Scale-in is a drain: before a node leaves its group it drains its server, then lets the group terminate it.

`pdstack node drain` runs the bundle's playbooks/node_drain.yml on the node with the variables of its last apply
(the bootstrap's apply-vars.json: the same scheduler, the same token the server joined with). The server's drain
stops new requests, waits for in-flight ones and prefill's KV leases to end, deregisters and stops the containers.

In the cloud the trigger is the group's termination lifecycle hook (pdstack.contract.node_lifecycle.DRAIN_HOOK): the
instance's metadata says its target lifecycle state is Terminated, `pdstack node watch-termination` sees it, drains,
and completes the lifecycle action (CONTINUE), so the group terminates the instance only after the drain; if the node
never answers, the hook's timeout (request, KV lease and settle time) ends the wait. Locally `pdstack local scale`
runs the same `pdstack node drain` in the node before it removes it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pdstack.contract.node_lifecycle import DRAIN_DEFAULT_RESULT, DRAIN_HOOK, node_group_name
from pdstack.node.apply import VARS_FILE, PlaybookRun, Runner, playbook_run, subprocess_runner
from pdstack.node.config import NodeConfig
from pdstack.node.loader import CURRENT_VENV, STATE_DIR

DRAIN_PLAYBOOK = "playbooks/node_drain.yml"
IMDS = "http://169.254.169.254"
TARGET_STATE_PATH = "/latest/meta-data/autoscaling/target-lifecycle-state"
TERMINATED = "Terminated"


WATCH_UNIT = "pdstack-node-termination-watch.service"
UNIT_DIR = Path("/etc/systemd/system")


class DrainError(RuntimeError):
    """The node cannot drain (it never applied a release) or its drain failed."""


def drain_node(
    state_dir: Path = STATE_DIR, *, runner: Runner = subprocess_runner, bin_dir: Path | None = None
) -> PlaybookRun:
    """Drain this node's server with the variables and the bundle of its last apply."""
    vars_file = state_dir / VARS_FILE
    if not vars_file.is_file():
        raise DrainError(f"no {vars_file}: this node never applied a release, so it serves nothing to drain")
    bundle = state_dir / "bundles" / json.loads(vars_file.read_text())["pdstack_bundle_sha256"]
    if not (bundle / DRAIN_PLAYBOOK).is_file():
        raise DrainError(f"the bundle the node last applied ({bundle}) has no {DRAIN_PLAYBOOK}")
    run = playbook_run(bundle, DRAIN_PLAYBOOK, vars_file, bin_dir)
    code = runner(run)
    if code != 0:
        raise DrainError(f"{Path(run.argv[0]).name} {DRAIN_PLAYBOOK} exited {code}")
    return run


def complete_termination(autoscaling: Any, config: NodeConfig, instance: str) -> None:
    """Let the pool's group terminate this instance now (the drain is done)."""
    autoscaling.complete_lifecycle_action(
        LifecycleHookName=DRAIN_HOOK,
        AutoScalingGroupName=node_group_name(str(config.environment), config.datacenter, config.pool),
        InstanceId=instance,
        LifecycleActionResult=DRAIN_DEFAULT_RESULT,
    )


def imds_target_state(base: str = IMDS, timeout_s: float = 2.0) -> str | None:
    """The instance's target lifecycle state from its metadata (IMDSv2); None when the instance has none to say."""
    try:
        with httpx.Client(base_url=base, timeout=timeout_s) as imds:
            token = imds.put("/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
            token.raise_for_status()
            answer = imds.get(TARGET_STATE_PATH, headers={"X-aws-ec2-metadata-token": token.text})
    except httpx.HTTPError:
        return None
    return answer.text.strip() if answer.status_code == 200 else None


def wait_for_termination(
    read_state: Callable[[], str | None] = imds_target_state,
    *,
    poll_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once the instance's group has chosen it for termination."""
    while read_state() != TERMINATED:
        sleep(poll_s)


def watch_unit_text(state_dir: Path = STATE_DIR) -> str:
    python = state_dir / CURRENT_VENV / "bin" / "python"
    return f"""\
[Unit]
Description=pdstack node: drain when the group chooses this instance for scale-in (pdstack/node/drain.py)
After=pdstack-node-bootstrap.service

[Service]
Type=simple
ExecStart={python} -m pdstack.node watch-termination
Restart=on-failure
RestartSec=10

[Install]
WantedBy=multi-user.target
"""


def install_termination_watch(
    state_dir: Path = STATE_DIR, unit_dir: Path = UNIT_DIR, run: Callable[..., Any] = subprocess.run
) -> None:
    """A cloud node, once serving, watches for its group's scale-in (started now, and at every boot)."""
    (unit_dir / WATCH_UNIT).write_text(watch_unit_text(state_dir))
    for argv in (["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", WATCH_UNIT]):
        run(argv, check=True, capture_output=True)
