"""The apply phase's split: the bundle's play run for real with the task-times callback the node enables
(plugins/callback/pdstack_task_times.py), and how its tasks' times become image pulls, roles and engine start."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from pdstack.node.apply import (
    ANSIBLE_CFG,
    COLLECTIONS_DIR,
    ROLES_DIR,
    TASK_TIMES_CALLBACK,
    TASK_TIMES_ENV,
    TASK_TIMES_FILE,
    apply_parts,
    playbook_run,
    subprocess_runner,
)
from tests.support import REPO

# A server role's shape, as roles/pdserve runs it on a node: set-up, the image pulled, the container started, the
# wait until it is routed to. The podman tasks change nothing (an image and a container that do not exist).
SERVER_TASKS = """
- name: Set the server up
  ansible.builtin.command: sleep 0.3
  changed_when: false
- name: Pull the runtime image by digest
  containers.podman.podman_image:
    name: localhost/pdstack-apply-test-absent
    state: absent
- name: Run the container
  containers.podman.podman_container:
    name: pdstack-apply-test-absent
    state: absent
- name: Wait until the component is ready
  ansible.builtin.command: sleep 0.3
  changed_when: false
"""
PLAYBOOK = """
- name: A baseline
  hosts: localhost
  gather_facts: false
  tasks:
    - name: A baseline role's work
      ansible.builtin.command: sleep 0.3
      changed_when: false
- name: The node's server
  hosts: localhost
  gather_facts: false
  roles: [pdserve]
"""


def test_the_callback_reads_the_file_the_node_names() -> None:
    spec = importlib.util.spec_from_file_location("cb", REPO / "plugins/callback" / f"{TASK_TIMES_CALLBACK}.py")
    assert spec is not None and spec.loader is not None
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    assert (plugin.OUTPUT_ENV, plugin.CallbackModule.CALLBACK_NAME) == (TASK_TIMES_ENV, TASK_TIMES_CALLBACK)


@pytest.mark.slow  # ansible-playbook, for real
def test_a_played_bundle_splits_its_seconds_into_image_roles_and_engine_start(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / ROLES_DIR / "pdserve" / "tasks").mkdir(parents=True)
    (bundle / ROLES_DIR / "pdserve" / "tasks" / "main.yml").write_text(SERVER_TASKS)
    (bundle / "playbooks").mkdir()
    (bundle / "playbooks" / "node.yml").write_text(PLAYBOOK)
    shutil.copy(REPO / ANSIBLE_CFG, bundle / ANSIBLE_CFG)
    (bundle / "plugins").symlink_to(REPO / "plugins")  # the strategy ansible.cfg names, and the callback
    (bundle / COLLECTIONS_DIR).mkdir()
    (bundle / COLLECTIONS_DIR / "ansible_collections").symlink_to(installed_collections())
    state = tmp_path / "state"
    state.mkdir()
    vars_file = state / "apply-vars.json"
    vars_file.write_text("{}")

    run = playbook_run(bundle, "playbooks/node.yml", vars_file, Path(sys.executable).parent)
    # a node's PATH: Debian's python3 (this machine's PATH may start with pyenv's shims, which Mitogen cannot start)
    run = dataclasses.replace(run, env={**run.env, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    started = time.monotonic()
    assert subprocess_runner(run) == 0
    total = time.monotonic() - started

    tasks = json.loads((state / TASK_TIMES_FILE).read_text())
    assert [(t["play"], t["role"], t["action"]) for t in tasks] == [
        (0, "", "ansible.builtin.command"),
        (1, "pdserve", "ansible.builtin.command"),
        (1, "pdserve", "containers.podman.podman_image"),
        (1, "pdserve", "containers.podman.podman_container"),
        (1, "pdserve", "ansible.builtin.command"),
    ]
    parts = apply_parts(state, total)
    assert list(parts) == ["image", "roles", "engine_start"]
    assert parts["image"] == pytest.approx(tasks[2]["end"] - tasks[2]["start"])
    assert parts["engine_start"] == pytest.approx(tasks[4]["end"] - tasks[3]["start"])
    assert parts["engine_start"] > 0.3 and parts["roles"] > 0.6  # the sleeps each side of the container's start
    assert sum(parts.values()) == pytest.approx(total)


def installed_collections() -> Path:
    spec = importlib.util.find_spec("ansible_collections")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def task(action: str, role: str, start: float, end: float) -> dict[str, object]:
    return {"play": 1, "role": role, "action": action, "start": start, "end": end}


def write_tasks(state: Path, tasks: list[dict[str, object]]) -> Path:
    (state / TASK_TIMES_FILE).write_text(json.dumps(tasks))
    return state


def test_engine_start_begins_at_the_servers_container_not_a_drains(tmp_path: Path) -> None:
    tasks = [
        task("containers.podman.podman_container", "serving_node", 10.0, 11.0),  # draining the replaced one
        task("containers.podman.podman_image", "vllm_engine", 11.0, 14.0),
        task("containers.podman.podman_image", "vllm_engine", 14.0, 15.0),  # the agent's image
        task("containers.podman.podman_container", "vllm_engine", 15.0, 16.0),
        task("ansible.builtin.uri", "serving_node", 16.0, 20.0),
    ]
    assert apply_parts(write_tasks(tmp_path, tasks), 30.0) == {"image": 4.0, "roles": 21.0, "engine_start": 5.0}


def test_engine_start_begins_after_the_pulls_not_at_the_other_engines_container(tmp_path: Path) -> None:
    """A vLLM node's play passes through pdserve's role first (its container looked for, and removed on an engine
    switch): the engine's start is vLLM's, after its image came."""
    tasks = [
        task("containers.podman.podman_container", "pdserve", 1.0, 2.0),
        task("containers.podman.podman_image", "vllm_engine", 5.0, 65.0),
        task("containers.podman.podman_container", "vllm_engine", 66.0, 70.0),
        task("ansible.builtin.uri", "serving_node", 70.0, 90.0),
    ]
    assert apply_parts(write_tasks(tmp_path, tasks), 100.0) == {"image": 60.0, "roles": 16.0, "engine_start": 24.0}


def test_a_play_without_a_server_start_is_all_roles_and_no_times_no_split(tmp_path: Path) -> None:
    tasks = [task("ansible.builtin.command", "time_sync", 0.0, 2.0)]
    assert apply_parts(write_tasks(tmp_path, tasks), 9.0) == {"image": 0.0, "roles": 9.0, "engine_start": 0.0}
    assert apply_parts(tmp_path / "nothing-ran", 9.0) == {}
