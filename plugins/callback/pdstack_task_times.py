"""Each task's play, role, module and start and end times, written as JSON when the playbook ends.

A node's bootstrap enables it for the play it applies to itself (pdstack/node/apply.py: `ANSIBLE_CALLBACKS_ENABLED`,
the file in `PDSTACK_TASK_TIMES`) to split the apply phase into pulling images, the roles and starting the engine.
A task ends where the next one starts (as ansible.posix's profile_tasks counts): one host, the node itself.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: pdstack_task_times
type: aggregate
short_description: Writes each task's play, role, module and times to a JSON file
description:
  - At the end of the playbook, a JSON list of {play, role, action, start, end} (seconds since the epoch), one per
    task in the order they ran, to the file PDSTACK_TASK_TIMES names. Nothing is written without it.
requirements:
  - enable in configuration (callbacks_enabled)
"""

OUTPUT_ENV = "PDSTACK_TASK_TIMES"


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "pdstack_task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._play = -1
        self._tasks: list[dict[str, Any]] = []

    def _end_last(self, now: float) -> None:
        if self._tasks and self._tasks[-1]["end"] is None:
            self._tasks[-1]["end"] = now

    def v2_playbook_on_play_start(self, play: Any) -> None:
        self._end_last(time.time())
        self._play += 1

    def v2_playbook_on_task_start(self, task: Any, is_conditional: bool) -> None:
        now = time.time()
        self._end_last(now)
        role = task._role.get_name() if task._role else ""
        action = task.resolved_action or task.action
        self._tasks.append({"play": self._play, "role": role, "action": action, "start": now, "end": None})

    def v2_playbook_on_handler_task_start(self, task: Any) -> None:
        self.v2_playbook_on_task_start(task, False)

    def v2_playbook_on_stats(self, stats: Any) -> None:
        self._end_last(time.time())
        output = os.environ.get(OUTPUT_ENV)
        if output:
            with open(output, "w", encoding="utf-8") as out:
                json.dump(self._tasks, out)
