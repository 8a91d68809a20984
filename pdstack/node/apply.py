"""Phase `apply`: the node applies the bundle's playbook to itself (connection local), with what the bootstrap
learnt as extra variables: who it is (the names roles/ and inventories/aws already use: pdstack_environment,
pdstack_datacenter, pdstack_region, pdstack_pool, pdstack_role), what it runs (the release's name, images by digest
and bundle, the model and where its verified files are), where its secrets and registry credentials are (files,
never values) and where to ask for the scheduler's URL (the control region, the local AWS endpoint, the parameter).

These are facts, not the roles' arguments: playbooks/node.yml maps them onto the variables the operators'
inventories give (playbooks/vars/node.yml, loaded after the operators' vars/serving.yml), so the mapping is written
once, in the bundle. `pdstack_release` stays the operators' {version, image, config_version} there: the release's
name comes as `pdstack_release_name`.

The variables go in a file (`-e @FILE`, mode 0600 though it holds only names and paths), so the command line is
short and the exact input of the last run stays on the node to read. The runner is injectable: tests check the
command, the node runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack.contract.components import scheduler_url_parameter
from pdstack.node.config import NodeConfig
from pdstack.node.files import write_atomic
from pdstack.node.join import Joined
from pdstack.node.loader import BootstrapError, Phase
from pdstack.node.release import ReleaseRecord
from pdstack.node.secrets import SecretFiles

VARS_FILE = "apply-vars.json"
# The play's task times (plugins/callback/pdstack_task_times.py, in the bundle), to split the phase's seconds
TASK_TIMES_FILE = "apply-tasks.json"
TASK_TIMES_CALLBACK = "pdstack_task_times"
TASK_TIMES_ENV = "PDSTACK_TASK_TIMES"  # the callback's OUTPUT_ENV
IMAGE_ACTIONS = frozenset({"containers.podman.podman_image"})
SERVER_ROLES = frozenset({"pdserve", "vllm_engine"})  # node.yml's server: its first container task starts the engine
CONTAINER_ACTION = "containers.podman.podman_container"
# Inside the bundle (pdstack/node/bundle.py writes them there): the roles, and the Ansible collections they use
# (containers.podman, community.general, ansible.posix; amazon.aws for the scheduler URL's lookup) as
# collections/ansible_collections/<namespace>/<name>: the venv has ansible-core only.
ROLES_DIR = "roles"
COLLECTIONS_DIR = "collections"
ANSIBLE_CFG = "ansible.cfg"
PLUGINS_DIR = "plugins"  # ansible.cfg's strategy_plugins, relative to it (here and in the bundle), and the callback
CALLBACKS_DIR = f"{PLUGINS_DIR}/callback"


@dataclass(frozen=True)
class PlaybookRun:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the bootstrap's own environment
    cwd: Path


Runner = Callable[[PlaybookRun], int]


def extra_vars(
    config: NodeConfig,
    instance_id: str,
    record: ReleaseRecord,
    secrets: SecretFiles,
    registry_auth_file: Path,
    *,
    joined: Joined,
) -> dict[str, Any]:
    return {
        "pdstack_environment": str(config.environment),
        "pdstack_datacenter": config.datacenter,
        "pdstack_region": config.region,
        "pdstack_pool": config.pool,
        "pdstack_role": config.role,
        "pdstack_instance_id": instance_id,
        "pdstack_release_name": record.release,
        "pdstack_bundle_sha256": record.bundle.sha256,
        "pdstack_images": dict(record.images),
        "pdstack_model": {"name": record.model.name, "revision": record.model.revision, "dir": config.model_dir},
        "pdstack_secret_files": {name: str(path) for name, path in secrets.secrets.items()},
        "pdstack_tls_files": {name: str(path) for name, path in secrets.tls.items()},
        # the join phase's: the node's own scheduler token and the engine id it joined as (instance:<role>-<it>)
        "pdstack_instance_token_file": str(joined.token_file),
        "pdstack_engine_id": joined.engine_id,
        "container_runtime_auth_file": str(registry_auth_file),
        "pdstack_control_region": config.control_region,
        "pdstack_aws_endpoint_url": config.aws_endpoint_url or "",
        "pdstack_scheduler_url_parameter": scheduler_url_parameter(str(config.environment)),
    }


def playbook_run(bundle_dir: Path, playbook: str, vars_file: Path, bin_dir: Path | None = None) -> PlaybookRun:
    """ansible-playbook of one of the bundle's plays on this host, from the venv the bundle installed (bin_dir)."""
    bin_dir = bin_dir if bin_dir is not None else Path(sys.executable).parent
    argv = (
        str(bin_dir / "ansible-playbook"),
        "--inventory",
        "localhost,",
        "--connection",
        "local",
        "--extra-vars",
        f"@{vars_file}",
        str(bundle_dir / playbook),
    )
    env = {
        "ANSIBLE_ROLES_PATH": str(bundle_dir / ROLES_DIR),
        "ANSIBLE_COLLECTIONS_PATH": str(bundle_dir / COLLECTIONS_DIR),
        "ANSIBLE_CONFIG": str(bundle_dir / ANSIBLE_CFG),
        "ANSIBLE_CALLBACK_PLUGINS": str(bundle_dir / CALLBACKS_DIR),
        "ANSIBLE_CALLBACKS_ENABLED": TASK_TIMES_CALLBACK,
        TASK_TIMES_ENV: str(vars_file.parent / TASK_TIMES_FILE),
    }
    return PlaybookRun(argv, env, bundle_dir)


def subprocess_runner(run: PlaybookRun) -> int:
    """Run the play with its output on the bootstrap's own (the unit's journal)."""
    return subprocess.run(list(run.argv), env={**os.environ, **run.env}, cwd=run.cwd, check=False).returncode


def apply_bundle(
    bundle_dir: Path,
    record: ReleaseRecord,
    variables: Mapping[str, Any],
    state_dir: Path,
    *,
    runner: Runner = subprocess_runner,
    bin_dir: Path | None = None,
) -> PlaybookRun:
    if bundle_dir.name != record.bundle.sha256:  # loader.fetch_bundle unpacks a checked bundle under its sha256
        raise BootstrapError(Phase.APPLY, f"{bundle_dir} is not the release's bundle {record.bundle.sha256}")
    if not (bundle_dir / record.bundle.playbook).is_file():
        raise BootstrapError(Phase.APPLY, f"the bundle {record.bundle.key} has no {record.bundle.playbook}")
    vars_file = state_dir / VARS_FILE
    (state_dir / TASK_TIMES_FILE).unlink(missing_ok=True)  # a previous boot's
    write_atomic(vars_file, (json.dumps(dict(variables), indent=2, sort_keys=True) + "\n").encode(), 0o600)
    run = playbook_run(bundle_dir, record.bundle.playbook, vars_file, bin_dir)
    code = runner(run)
    if code != 0:
        raise BootstrapError(Phase.APPLY, f"{Path(run.argv[0]).name} {record.bundle.playbook} exited {code}")
    return run


def apply_parts(state_dir: Path, total: float) -> dict[str, float]:
    """The apply phase's `total` seconds split as the play ran them (the task times file of this run): `image`, the
    pulls; `engine_start`, from the server role's first container task after the pulls to the play's end (the start, and
    the wait until the scheduler routes to it; not the other engine's container a switch removes first); `roles`,
    the rest (the baseline, the server's set-up, Ansible's own start). Empty when the play left no times (it did not
    run)."""
    path = state_dir / TASK_TIMES_FILE
    if not path.is_file():
        return {}
    tasks: list[dict[str, Any]] = json.loads(path.read_text())
    if not tasks:
        return {}
    pulls = [t for t in tasks if t["action"] in IMAGE_ACTIONS]
    image = sum(t["end"] - t["start"] for t in pulls)
    pulled = max((t["end"] for t in pulls), default=tasks[0]["start"])  # an engine starts from its pulled image
    servers = [t for t in tasks if t["action"] == CONTAINER_ACTION and t["role"] in SERVER_ROLES]
    starts = [t["start"] for t in servers if t["start"] >= pulled]
    engine = tasks[-1]["end"] - min(starts) if starts else 0.0
    return {"image": image, "roles": max(total - image - engine, 0.0), "engine_start": engine}
