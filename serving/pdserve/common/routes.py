"""The routes every pdserve HTTP component serves beside its own API: liveness, readiness and Prometheus metrics
(the paths the deployment's probes and scrape jobs use)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

Endpoint = Callable[[Request], Awaitable[Response]]


def probe_routes(live: Endpoint, ready: Endpoint, metrics: Endpoint) -> list[Route]:
    """/health/live, /health/ready and /metrics, served by the component's own handlers."""
    return [Route("/health/live", live), Route("/health/ready", ready), Route("/metrics", metrics)]
