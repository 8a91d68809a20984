"""Latency against load as a PNG; matplotlib is an optional extra (`pdstack[plot]`)."""

from __future__ import annotations

from pathlib import Path

from pdstack.bench.report import BenchReport


class PlotUnavailable(RuntimeError):
    """--plot was asked for but matplotlib is not installed."""


def write_plot(report: BenchReport, path: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415  (optional dependency, imported only when a plot is asked for)

        matplotlib.use("Agg")
        from matplotlib import pyplot  # noqa: PLC0415
    except ImportError as exc:
        raise PlotUnavailable(
            "plot: matplotlib is not installed; install the plot extra (pip install 'pdstack[plot]') or drop --plot"
        ) from exc
    runs = sorted((r for r in report.runs if r.summary.completed), key=lambda r: r.summary.throughput_rps)
    load = [r.summary.offered_rate or r.summary.throughput_rps for r in runs]
    figure, axes = pyplot.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in zip(axes, ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "end to end"), strict=True):
        for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
            points = [(x, getattr(r.summary, metric).p.get(q)) for x, r in zip(load, runs, strict=True)]
            shown = [(x, y * 1000) for x, y in points if y is not None]  # e.g. no TPOT when max_tokens is 1
            ax.plot([x for x, _ in shown], [y for _, y in shown], style, label=f"p{q}")
        ax.set_title(f"{title} latency")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    figure.suptitle(f"{report.endpoint['model']} ({report.workload['name']}) at {report.endpoint['base_url']}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
