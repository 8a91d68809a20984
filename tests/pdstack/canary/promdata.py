"""Deterministic gateway and server metrics written as OpenMetrics, loaded into a real Prometheus TSDB.

`promtool tsdb create-blocks-from openmetrics` turns the text into blocks; a real `prometheus` then serves them, so the
canary queries run against the same PromQL engine as in production.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.gateway.metrics import LATENCY_BUCKETS, TOKEN_GAP_BUCKETS
from tests.support.process import Daemon

SCRAPE_S = 15


@dataclass(frozen=True)
class Traffic:
    """What one version did: requests per second, share of 5xx, latency medians, KV load failures per scrape."""

    version: str
    rps: float = 10.0
    error_share: float = 0.0
    ttft_s: float = 0.05
    itl_s: float = 0.01
    kv_failures_per_scrape: int = 0
    server: str = field(default="")


def _histogram_lines(
    name: str,
    labels: str,
    buckets: tuple[float, ...],
    rng: np.random.Generator,
    *,
    median: float,
    per_scrape: int,
    start: int,
    scrapes: int,
) -> list[str]:
    lines = []
    cumulative = np.zeros(len(buckets) + 1)
    total = 0.0
    for i in range(scrapes):
        values = median * rng.lognormal(0.0, 0.25, per_scrape)
        cumulative += np.bincount(np.searchsorted(buckets, values), minlength=len(buckets) + 1)
        total += float(values.sum())
        ts = start + i * SCRAPE_S
        running = np.cumsum(cumulative)
        for le, count in zip((*buckets, "+Inf"), running, strict=True):
            le_text = le if isinstance(le, str) else repr(float(le))
            lines.append(f'{name}_bucket{{{labels},le="{le_text}"}} {int(count)} {ts}')
        lines.append(f"{name}_count{{{labels}}} {int(running[-1])} {ts}")
        lines.append(f"{name}_sum{{{labels}}} {total} {ts}")
    return lines


def openmetrics(traffic: list[Traffic], start: int, scrapes: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    gw = 'instance="10.210.0.10:8000",job="pdserve-gateway"'
    out = ["# TYPE pdserve_gateway_requests counter"]
    for t in traffic:
        per_scrape = t.rps * SCRAPE_S
        for status, share in (("200", 1 - t.error_share), ("502", t.error_share)):
            if share == 0:
                continue
            labels = f'{gw},endpoint="/v1/completions",status="{status}",tenant="t",version="{t.version}"'
            out += [
                f"pdserve_gateway_requests_total{{{labels}}} {round(i * per_scrape * share)} {start + i * SCRAPE_S}"
                for i in range(scrapes)
            ]
    for family, buckets, attr in (
        ("pdserve_gateway_time_to_first_token_seconds", LATENCY_BUCKETS, "ttft_s"),
        ("pdserve_gateway_inter_token_latency_seconds", TOKEN_GAP_BUCKETS, "itl_s"),
    ):
        out.append(f"# TYPE {family} histogram")
        for t in traffic:
            out += _histogram_lines(
                family,
                f'{gw},version="{t.version}"',
                buckets,
                rng,
                median=getattr(t, attr),
                per_scrape=int(t.rps * SCRAPE_S),
                start=start,
                scrapes=scrapes,
            )
    out.append("# TYPE pdserve_build_info gauge")
    for t in traffic:
        if t.server:
            out += [
                f'pdserve_build_info{{instance="{t.server}",job="pdserve-decode",role="decode",'
                f'version="{t.version}"}} 1 {start + i * SCRAPE_S}'
                for i in range(scrapes)
            ]
    out.append("# TYPE pdserve_kv_load_failures counter")
    for t in traffic:
        if t.server:
            out += [
                f'pdserve_kv_load_failures_total{{instance="{t.server}",job="pdserve-decode",cause="checksum",'
                f'action="fail"}} {i * t.kv_failures_per_scrape} {start + i * SCRAPE_S}'
                for i in range(scrapes)
            ]
    out.append("# EOF")
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def prometheus_with(text: str, port: int) -> Iterator[str]:
    """A real Prometheus serving `text` (OpenMetrics) on 127.0.0.1:`port`; yields its base URL."""
    for tool in ("promtool", "prometheus"):
        assert shutil.which(tool), f"{tool} is not installed: apt-get install prometheus"
    with tempfile.TemporaryDirectory(prefix="pdstack-prom-") as folder:
        root = Path(folder)
        (root / "data.om").write_text(text)
        (root / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
        subprocess.run(
            ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(root / "data.om"), str(root / "tsdb")],
            check=True,
            capture_output=True,
        )
        url = f"http://127.0.0.1:{port}"
        argv = [
            "prometheus",
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=10y",
        ]
        prometheus = Daemon("prometheus", argv, url, root / "prometheus.log")
        try:
            prometheus.start(timeout=60)
            yield url
        finally:
            prometheus.stop(grace=20)
