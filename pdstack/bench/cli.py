"""The `pdstack bench` command's options; pdstack/cli.py registers `bench_command`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def _floats(text: str | None, name: str) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=name) from exc


def bench_command(  # typer builds one option per parameter
    *,
    url: Annotated[str, typer.Option(help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000 (/v1 optional)")],
    rate: Annotated[str | None, typer.Option(help="fixed offered rates in req/s, comma-separated")] = None,
    peak_shares: Annotated[
        str | None, typer.Option(help="measure the peak, then run at these percentages of it, e.g. 50,80,100")
    ] = None,
    model: Annotated[str | None, typer.Option(help="model to request (default: the endpoint's first)")] = None,
    api: Annotated[str, typer.Option(help="chat (/v1/chat/completions) or completions (/v1/completions)")] = "chat",
    api_key_file: Annotated[Path | None, typer.Option(help="file holding the API key (sent as a Bearer token)")] = None,
    workload: Annotated[str, typer.Option(help="prompt lengths: short (32-128 words), long (512-2048), mixed")] = (
        "mixed"
    ),
    requests: Annotated[int, typer.Option(help="requests per run (at most)")] = 100,
    max_duration: Annotated[float, typer.Option(help="seconds of arrivals per run (at most)")] = 120.0,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of each request")] = 64,
    ignore_eos: Annotated[bool, typer.Option(help="ask the server to ignore EOS (vLLM extension)")] = False,
    seed: Annotated[int, typer.Option(help="seed of arrivals and prompts")] = 0,
    max_in_flight: Annotated[int, typer.Option(help="safety cap; arrivals beyond it count as 'overload' errors")] = 256,
    timeout: Annotated[float, typer.Option(help="seconds a request may take before it counts as a timeout")] = 120.0,
    slo_ttft_ms: Annotated[float, typer.Option(help="TTFT objective for goodput")] = 1000.0,
    slo_tpot_ms: Annotated[float, typer.Option(help="TPOT objective for goodput")] = 100.0,
    probe_seconds: Annotated[float, typer.Option(help="seconds per concurrency step of the peak probe")] = 10.0,
    probe_max_concurrency: Annotated[int, typer.Option(help="highest concurrency the peak probe tries")] = 64,
    warmup: Annotated[int, typer.Option(help="unmeasured requests sent one by one before measuring")] = 1,
    metrics_url: Annotated[
        str | None, typer.Option(help="the server's Prometheus /metrics, to compare percentiles with its histograms")
    ] = None,
    metrics_token_file: Annotated[
        Path | None,
        typer.Option(help="file holding the token --metrics-url requires (Bearer; the gateway's metrics token)"),
    ] = None,
    ttft_metric: Annotated[str | None, typer.Option(help="TTFT histogram name (default: found by name)")] = None,
    e2e_metric: Annotated[str | None, typer.Option(help="end-to-end histogram name (default: found by name)")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the full results as JSON here")] = None,
    plot: Annotated[Path | None, typer.Option(help="write latency against load as a PNG here")] = None,
) -> None:
    """Open-loop (Poisson) streaming load against an OpenAI-compatible endpoint: TTFT, TPOT, e2e, goodput, errors."""
    # The load generator (httpx, numpy, rich.progress) loads only when a bench runs, not with every `pdstack` command.
    from rich.console import Console  # noqa: PLC0415

    from pdstack.bench.command import BenchError, BenchOptions, command_line, run_bench  # noqa: PLC0415
    from pdstack.bench.endpoint import EndpointError  # noqa: PLC0415
    from pdstack.bench.peak import PeakError  # noqa: PLC0415
    from pdstack.bench.plot import write_plot  # noqa: PLC0415
    from pdstack.bench.report import server_lines, table  # noqa: PLC0415
    from pdstack.bench.stats import SLO  # noqa: PLC0415
    from pdstack.bench.workload import BenchWorkloadError  # noqa: PLC0415

    console = Console(stderr=True)
    options = BenchOptions(
        url=url,
        model=model,
        api=api,
        api_key_file=api_key_file,
        workload=workload,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        rates=_floats(rate, "--rate"),
        peak_shares=_floats(peak_shares, "--peak-shares"),
        requests=requests,
        max_duration_s=max_duration,
        seed=seed,
        max_in_flight=max_in_flight,
        timeout_s=timeout,
        slo=SLO(slo_ttft_ms / 1000, slo_tpot_ms / 1000),
        probe_seconds=probe_seconds,
        probe_max_concurrency=probe_max_concurrency,
        warmup=warmup,
        metrics_url=metrics_url,
        metrics_token_file=metrics_token_file,
        ttft_metric=ttft_metric,
        e2e_metric=e2e_metric,
    )
    if plot is not None:
        _check_plot_available()
    try:
        report = run_bench(options, command_line(), console)
    except (BenchError, EndpointError, BenchWorkloadError, PeakError) as exc:
        typer.echo(f"bench: {exc}", err=True)
        raise typer.Exit(2) from exc
    # a pipe or file gets the whole table unwrapped; a terminal gets its own width
    Console(width=None if sys.stdout.isatty() else 200).print(table(report))
    for line in server_lines(report):
        typer.echo(line)
    if json_path is not None:
        report.write_json(json_path)
        typer.echo(f"results: {json_path}")
    if plot is not None:
        write_plot(report, plot)
        typer.echo(f"plot: {plot}")


def _check_plot_available() -> None:
    """Fail before any load is sent, not after, when --plot cannot be honoured."""
    from pdstack.bench.plot import PlotUnavailable  # noqa: PLC0415 (see bench_command)

    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError as exc:
        typer.echo(f"bench: {PlotUnavailable.__doc__} Install the plot extra: pip install 'pdstack[plot]'", err=True)
        raise typer.Exit(2) from exc
