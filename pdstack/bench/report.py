"""The results of a bench: one record per run, rendered as a rich table and as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from pdstack.bench.client import RequestResult
from pdstack.bench.peak import Peak
from pdstack.bench.promhist import QuantileCheck
from pdstack.bench.stats import QUANTILES, Distribution, Summary


@dataclass
class RunRecord:
    """One open-loop run at one offered rate."""

    label: str
    summary: Summary
    results: list[RequestResult]
    client_lag: Distribution = field(default_factory=lambda: Distribution.of([]))
    server_checks: list[QuantileCheck] = field(default_factory=list)
    server_note: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            **self.summary.as_json(),
            "client_loop_lag_s": self.client_lag.as_json(),
            "server_histograms": {
                "note": self.server_note,
                "checks": [c.as_json() for c in self.server_checks],
            },
            "requests_detail": [r.as_json() for r in self.results],
        }


@dataclass
class BenchReport:
    command: str
    started_at: str
    endpoint: dict[str, Any]
    models: dict[str, Any]
    workload: dict[str, Any]
    peak: Peak | None
    runs: list[RunRecord]
    host: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "started_at": self.started_at,
            "endpoint": self.endpoint,
            "models": self.models,
            "host": self.host,
            "workload": self.workload,
            "peak": self.peak.as_json() if self.peak else None,
            "runs": [r.as_json() for r in self.runs],
        }

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_json(), indent=2) + "\n")


def _ms(dist: Distribution) -> str:
    if not dist.count:
        return "-"
    return " / ".join(f"{dist.p[q] * 1000:.0f}" for q in QUANTILES)


def _errors(summary: Summary) -> str:
    return ", ".join(f"{cause} {n}" for cause, n in summary.errors.items()) or "-"


def table(report: BenchReport) -> Table:
    quantiles = "/".join(f"p{q}" for q in QUANTILES)
    title = f"pdstack bench: {report.endpoint['model']} at {report.endpoint['base_url']} ({report.workload['name']})"
    if report.peak is not None:
        title += f"; peak {report.peak.rate_rps:.2f} req/s at concurrency {report.peak.concurrency}"
    out = Table(title=title)
    for header in (
        "load",
        "offered req/s",
        "answered req/s",
        "ok/sent",
        f"TTFT ms {quantiles}",
        f"TPOT ms {quantiles}",
        f"E2E ms {quantiles}",
        "out tok/s",
        "goodput req/s (SLO met)",
        "errors",
    ):
        out.add_column(header, justify="left" if header in ("load", "errors") else "right")
    for run in report.runs:
        s = run.summary
        out.add_row(
            run.label,
            f"{s.offered_rate:.2f}" if s.offered_rate is not None else "-",
            f"{s.throughput_rps:.2f}",
            f"{s.completed}/{s.requests}",
            _ms(s.ttft),
            _ms(s.tpot),
            _ms(s.e2e),
            f"{s.output_tokens_per_s:.1f}",
            f"{s.goodput_rps:.2f} ({s.slo_attainment:.0%})",
            _errors(s),
        )
    return out


def server_lines(report: BenchReport) -> list[str]:
    """One line per percentile compared with the server's histograms."""
    lines = []
    for run in report.runs:
        if run.server_note:
            lines.append(f"{run.label}: {run.server_note}")
        for check in run.server_checks:
            lower, upper = check.bucket
            verdict = "agrees" if check.agrees else "DISAGREES"
            lines.append(
                f"{run.label}: {check.metric} p{check.q} vs bench {check.measure} {check.bench_s * 1000:.1f} ms: "
                f"server bucket ({lower * 1000:g}, {upper * 1000:g}] ms (+{check.allowance_s * 1000:.1f} ms "
                f"allowance): {verdict}"
            )
    return lines
