"""Every panel query of the committed dashboards, run against a real Prometheus (loopback tests and tests/local)."""

from __future__ import annotations

import json
import ssl
import time

import httpx

from pdstack.dashboards.promql import expand, metric_names, panels
from tests.support import REPO

DASHBOARDS = REPO / "monitoring" / "dashboards"
VLLM_PREFIX = "vllm:"


def dashboard_queries() -> list[tuple[str, str, list[str]]]:
    """(dashboard, panel title, [expr, ...]) of every panel of every committed dashboard."""
    return [
        (path.stem, title, exprs)
        for path in sorted(DASHBOARDS.glob("*.json"))
        for title, exprs in panels(json.loads(path.read_text()))
    ]


def query_problems(prometheus: str, window_s: float, step_s: float, verify: ssl.SSLContext | bool = True) -> list[str]:
    """Queries Prometheus refuses, and queries returning no series over the last `window_s`. A query reading vllm:
    metrics may return none (the other engine runs); every other one must, or its selector matches nothing.
    `verify`: httpx's, for a Prometheus serving HTTPS (the local environment's, under mutual TLS)."""
    now = time.time()
    problems = []
    with httpx.Client(timeout=10, verify=verify) as client:
        for board, title, exprs in dashboard_queries():
            for expr in exprs:
                answer = client.get(
                    f"{prometheus}/api/v1/query_range",
                    params={"query": expand(expr), "start": str(now - window_s), "end": str(now), "step": str(step_s)},
                ).json()
                if answer["status"] != "success":
                    problems.append(f"{board} / {title}: {expr}: {answer.get('error')}")
                elif not answer["data"]["result"] and not any(
                    name.startswith(VLLM_PREFIX) for name in metric_names(expr)
                ):
                    problems.append(f"{board} / {title}: no series: {expr}")
    return problems
