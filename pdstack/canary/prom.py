"""Canary observations from Prometheus: what `judge()` needs for one version over one analysis window.

Requests and successes come from the gateway's request counter (label `version`; a success is any answer that is not
5xx, as Flagger's request-success-rate). TTFT and inter-token latency p95 are sampled at `points` steps across the
window (histogram_quantile over rate() of the gateway's histograms), giving the judge one value per step to test.
KV failures are requests whose decode could not use remote KV (`pdserve_kv_load_failures_total`, counted alike by a
pdserve server and by PdstackConnector in a vLLM engine), joined to the version through each one's
`pdserve_build_info` on the scrape's instance.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
import yaml

from pdstack.canary import client_tls
from pdstack.canary.judge import Observations

DEFAULT_POINTS = 10


class PrometheusError(RuntimeError):
    """Prometheus could not answer a query; the message names the query and the cause."""


@dataclass(frozen=True)
class Prometheus:
    """A tiny client for the HTTP API's instant and range queries."""

    url: str
    timeout_s: float = 10.0

    def _get(self, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
        try:
            response = httpx.get(
                self.url.rstrip("/") + path, params=params, timeout=self.timeout_s, verify=client_tls.verify()
            )
        except httpx.HTTPError as exc:
            raise PrometheusError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            raise PrometheusError(f"{self.url}: HTTP {response.status_code}, not a Prometheus API answer") from None
        if body.get("status") != "success":
            raise PrometheusError(f"query {params.get('query')!r}: {body.get('errorType')}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def scrape_interval_s(self) -> float:
        """The global scrape interval from the running configuration (Prometheus' default 1m when unset)."""
        try:
            response = httpx.get(
                self.url.rstrip("/") + "/api/v1/status/config", timeout=self.timeout_s, verify=client_tls.verify()
            )
            config = yaml.safe_load(response.json()["data"]["yaml"]) or {}
        except (httpx.HTTPError, ValueError, KeyError, yaml.YAMLError) as exc:
            raise PrometheusError(f"{self.url}: cannot read the configuration: {exc}") from exc
        return duration_s(str((config.get("global") or {}).get("scrape_interval", "1m")))

    def scalar(self, query: str, at: float) -> float:
        """The sum of an instant vector's values at `at` (0 when the vector is empty)."""
        series = self._get("/api/v1/query", {"query": query, "time": f"{at:.3f}"})
        return sum(float(s["value"][1]) for s in series)

    def points(self, query: str, start: float, end: float, step: float) -> list[float]:
        """The values of a single-series range query (empty when there is no series)."""
        series = self._get(
            "/api/v1/query_range", {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"}
        )
        if len(series) > 1:
            raise PrometheusError(f"query {query!r}: expected one series, got {len(series)}")
        return [float(value) for _, value in series[0]["values"]] if series else []


def duration_s(text: str) -> float:
    """A Prometheus duration such as `5s`, `1m30s` or `500ms`, in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise PrometheusError(f"scrape_interval: not a Prometheus duration: {text!r}")
    return sum(int(n) * units[u] for n, u in parts)


def _selector(version: str) -> str:
    escaped = version.replace("\\", "\\\\").replace('"', '\\"')
    return f'version="{escaped}"'


def queries(version: str, window_s: int, rate_window_s: int) -> dict[str, str]:
    """The PromQL for one version; exposed so operators can paste the same queries into Prometheus."""
    v = _selector(version)
    quantile = "histogram_quantile(0.95, sum by (le) (rate({metric}_bucket{{{v}}}[{r}s])))"
    return {
        "requests": f"sum(increase(pdserve_gateway_requests_total{{{v}}}[{window_s}s]))",
        "successes": f'sum(increase(pdserve_gateway_requests_total{{{v},status!~"5.."}}[{window_s}s]))',
        "kv_transfer_failures": (
            f"sum(increase(pdserve_kv_load_failures_total[{window_s}s])"
            f" * on (instance) group_left () pdserve_build_info{{{v}}})"
        ),
        "ttft_p95_s": quantile.format(metric="pdserve_gateway_time_to_first_token_seconds", v=v, r=rate_window_s),
        "itl_p95_s": quantile.format(metric="pdserve_gateway_inter_token_latency_seconds", v=v, r=rate_window_s),
    }


def observe(
    prom: Prometheus, version: str, window_s: int, end: float | None = None, points: int = DEFAULT_POINTS
) -> Observations:
    """Observations of `version` over the `window_s` seconds before `end` (default: now)."""
    if window_s <= 0:
        raise ValueError(f"window: must be > 0 seconds, got {window_s}")
    if points < 3:
        raise ValueError(f"points: the judge needs at least 3 per metric, got {points}")
    end = time.time() if end is None else end
    # Each point's rate() needs two scrapes of its own, or it is empty (or repeats its neighbour's data).
    scrape_s = prom.scrape_interval_s()
    points = min(points, int(window_s // (2 * scrape_s)))
    if points < 3:
        raise ValueError(
            f"window: {window_s} s holds fewer than 3 latency points at a {scrape_s:g} s scrape interval; "
            f"give at least {math.ceil(6 * scrape_s)} s"
        )
    step = window_s / points
    rate_window = max(math.ceil(step), 1)
    q = queries(version, window_s, rate_window)
    # The first latency point sits one step into the window, so each point's rate() covers only the window.
    start = end - window_s + step
    return Observations(
        requests=round(prom.scalar(q["requests"], end)),
        successes=round(prom.scalar(q["successes"], end)),
        kv_transfer_failures=round(prom.scalar(q["kv_transfer_failures"], end)),
        ttft_p95_s=prom.points(q["ttft_p95_s"], start, end, step),
        itl_p95_s=prom.points(q["itl_p95_s"], start, end, step),
    )
