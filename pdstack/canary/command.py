"""`pdstack canary judge|golden`: the checks deploy.yml runs at every canary step.

Exit codes: 0 pass, 1 fail (the report names the metric, both values and the threshold; for golden, also a canary
that answers a golden prompt with an error), 2 bad input or an endpoint that cannot be used, 3 inconclusive (too few
requests, past the retries allowed). `judge` judges one step: consecutive windows until one decides (judge.judge_step).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from pdstack.canary.golden import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPTS,
    AnswerError,
    GoldenError,
    GoldenFile,
    compare,
    generate,
    load_golden,
)
from pdstack.canary.judge import Outcome, Verdict, judge, judge_step
from pdstack.canary.prom import DEFAULT_POINTS, Prometheus, PrometheusError, observe
from pdstack.model import Canary
from pdstack.stacks.options import JsonOption, StacksOption, environment, stacks_dir

EXIT = {Outcome.PASS: 0, Outcome.FAIL: 1, Outcome.INCONCLUSIVE: 3}
canary_app = typer.Typer(
    help="Canary analysis: judge a canary from Prometheus, compare golden outputs.", no_args_is_help=True
)


def canary_policy(folder: Path, env: str) -> Canary:
    """The `pdstack:canary` section of the environment's stacks (the defaults when none has one)."""
    for stack in environment(folder, env).stacks:
        if stack.config.canary is not None:
            return stack.config.canary
    return Canary()


OldStackDir = Annotated[Path | None, typer.Option("--stack-dir", hidden=True, help="deprecated spelling of --stacks")]
EnvName = Annotated[str, typer.Option("--env", metavar="NAME", help="environment whose pdstack:canary policy applies")]


@canary_app.command("judge")
def judge_command(  # typer builds one option per parameter
    *,
    prometheus: Annotated[str, typer.Option(help="Prometheus base URL, e.g. http://10.210.0.10:9090")],
    canary: Annotated[str, typer.Option(help="canary version (the gateway's `version` label)")],
    baseline: Annotated[str, typer.Option(help="baseline version")],
    stacks: StacksOption = None,
    stack_dir: OldStackDir = None,
    env: EnvName = "local",
    window: Annotated[
        int | None, typer.Option(help="analysis window in seconds (default: the policy's interval)")
    ] = None,
    end: Annotated[float | None, typer.Option(help="first window's end, Unix seconds (default: now)")] = None,
    points: Annotated[int, typer.Option(help="latency samples per version across the window")] = DEFAULT_POINTS,
    failure_limit: Annotated[
        int | None,
        typer.Option(min=1, help="latency failures in a row before the step fails (default: the policy's)"),
    ] = None,
    inconclusive_limit: Annotated[
        int, typer.Option(min=0, help="further windows judged after inconclusive ones before giving up")
    ] = 0,
    as_json: JsonOption = False,
) -> None:
    """Judge canary against baseline over consecutive windows until one decides; exit 0 pass, 1 fail, 3
    inconclusive. Each further window is judged once it has ended."""
    policy = canary_policy(stacks_dir(stacks, stack_dir, "--stack-dir"), env)
    window_s = window if window is not None else int(policy.interval_s)
    windows = _Windows(Prometheus(prometheus), canary, baseline, policy, window_s, points)
    try:
        step = judge_step(windows.verdicts(end), failure_limit or policy.failure_limit, inconclusive_limit)
    except (PrometheusError, ValueError) as exc:
        typer.echo(f"canary judge: {exc}", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        last = step.windows[-1].as_json()
        windows_json = [{**w.as_json(), "end": e} for w, e in zip(step.windows, windows.ends, strict=True)]
        summary = {"outcome": step.outcome, "reason": step.reason, "report": step.report(), "windows": windows_json}
        typer.echo(json.dumps({**last, **summary, "canary": canary, "baseline": baseline, "window_s": window_s}))
    else:
        over = f"{len(step.windows)} window(s) of {window_s} s"
        typer.echo(f"{step.outcome.upper()}: canary {canary} vs baseline {baseline} over {over}: {step.reason}")
        typer.echo(step.report())
    raise typer.Exit(EXIT[step.outcome])


@dataclass
class _Windows:
    """Consecutive analysis windows of canary and baseline, each judged once it has ended."""

    prom: Prometheus
    canary: str
    baseline: str
    policy: Canary
    window_s: int
    points: int
    ends: list[float] = field(default_factory=list)

    def verdicts(self, first_end: float | None) -> Iterator[Verdict]:
        window_end = time.time() if first_end is None else first_end
        while True:
            time.sleep(max(0.0, window_end - time.time()))
            seen_canary = observe(self.prom, self.canary, self.window_s, window_end, self.points)
            seen_baseline = observe(self.prom, self.baseline, self.window_s, window_end, self.points)
            self.ends.append(window_end)
            yield judge(seen_canary, seen_baseline, self.policy.thresholds, self.policy.min_samples)
            window_end += self.window_s


@canary_app.command("golden")
def golden_command(  # typer builds one option per parameter
    *,
    canary: Annotated[str, typer.Option(help="base URL of a canary server (or gateway)")],
    baseline: Annotated[str | None, typer.Option(help="base URL of a baseline server to compare with")] = None,
    golden: Annotated[Path | None, typer.Option(help="golden file: prompts, max_tokens, and maybe outputs")] = None,
    record: Annotated[Path | None, typer.Option(help="write the canary's outputs as a golden file and exit")] = None,
    api_key_file: Annotated[Path | None, typer.Option(help="file holding the API key (for a gateway)")] = None,
    model: Annotated[str | None, typer.Option(help="model name to request")] = None,
    as_json: JsonOption = False,
) -> None:
    """Greedy outputs of golden prompts: canary vs baseline, or vs the golden file's outputs. Exit 0 same, 1 not."""
    try:
        spec = load_golden(golden) if golden else GoldenFile(DEFAULT_MAX_TOKENS, list(DEFAULT_PROMPTS))
        api_key = api_key_file.read_text().strip() if api_key_file else None
        try:
            outputs = generate(canary, spec.prompts, spec.max_tokens, api_key, model)
        except AnswerError as exc:  # the canary answered, with an error: it fails, like a wrong output would
            typer.echo(f"FAIL golden_outputs: the canary failed a golden prompt: {exc}")
            raise typer.Exit(1) from exc
        if record is not None:
            GoldenFile(spec.max_tokens, spec.prompts, outputs).dump(record)
            typer.echo(f"recorded {len(outputs)} golden outputs to {record}")
            raise typer.Exit(0)
        if baseline is not None:
            expected = generate(baseline, spec.prompts, spec.max_tokens, api_key, model)
        elif spec.outputs is not None:
            expected = spec.outputs
        else:
            raise GoldenError("give --baseline, or a --golden file with outputs (a release that changes the model)")
        result = compare(outputs, expected)
    except (GoldenError, OSError) as exc:
        typer.echo(f"canary golden: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(result.as_json()) if as_json else result.report())
    raise typer.Exit(0 if result.passed else 1)


@canary_app.command("policy")
def policy_command(
    stacks: StacksOption = None,
    stack_dir: OldStackDir = None,
    env: EnvName = "local",
) -> None:
    """Print the environment's canary policy (steps, interval, minimum samples, thresholds) as JSON (always)."""
    typer.echo(canary_policy(stacks_dir(stacks, stack_dir, "--stack-dir"), env).model_dump_json())
