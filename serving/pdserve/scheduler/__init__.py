"""pdserve scheduler: instance registry with heartbeats, routing table, version weights (canary), P:D advice.

Run it with `pdserve scheduler --state-file F --admin-token-file T --identity-key-file K`
(or `python -m pdserve.scheduler`).
Servers report to it with `pdserve.scheduler.client.run_heartbeats`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.listener import serve

from .app import create_app
from .jsonlog import configure
from .settings import SchedulerSettings, load_settings


def main(argv: Sequence[str]) -> None:
    settings = load_settings(SchedulerSettings, argv, prog="pdserve scheduler")
    configure("scheduler", settings.log_level)
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise SystemExit(f"pdserve scheduler: {exc}") from None
    serve(app, settings.host, settings.port, log_level=settings.log_level)
