"""pdserve scheduler: instance registry with heartbeats, routing table, version weights (canary), P:D advice.

Run it with `pdserve scheduler --state-file F --admin-token-file T --identity-key-file K`
(or `python -m pdserve.scheduler`).
Servers report to it with `pdserve.scheduler.client.run_heartbeats`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.logs import configure
from pdserve.common.settings import load_settings
from pdserve.common.tracing import configure_tracing
from pdserve.listener import serve_component

from .app import create_app
from .settings import SchedulerSettings


def main(argv: Sequence[str]) -> None:
    settings = load_settings(SchedulerSettings, argv, prog="pdserve scheduler")
    configure("scheduler", settings.log_level)
    configure_tracing("scheduler", settings)
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise SystemExit(f"pdserve scheduler: {exc}") from None
    serve_component(app, settings)
