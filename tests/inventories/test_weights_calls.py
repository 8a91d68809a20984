"""Every traffic-weights call (roles/pdserve/tasks/weights.yml, which carries the scheduler's admin token) is made
from a play on the controller, in serving.yml, deploy.yml and rollback.yml: weights.yml delegates to the first
control node where the inventory has one (inventories/local) and otherwise runs where it is included, so a weights
call in a play on the GPU nodes would, in the cloud, send the admin token from a model server's node."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support import REPO


def weights_calls(tasks: list[dict[str, Any]]) -> int:
    found = 0
    for task in tasks:
        include = task.get("ansible.builtin.include_role") or task.get("include_role") or {}
        found += include.get("tasks_from") == "weights.yml"
        for key in ("block", "rescue", "always"):
            found += weights_calls(task.get(key, []))
    return found


@pytest.mark.parametrize("playbook", ["serving.yml", "deploy.yml", "rollback.yml"])
def test_weights_are_set_only_from_the_controller(playbook: str) -> None:
    plays = yaml.safe_load((REPO / "playbooks" / playbook).read_text())
    calls = {play["name"]: (play["hosts"], weights_calls(play.get("tasks", []))) for play in plays if "hosts" in play}
    assert any(n for _, n in calls.values()), playbook  # the check sees the calls it is about
    assert {name: hosts for name, (hosts, n) in calls.items() if n and hosts != "localhost"} == {}
