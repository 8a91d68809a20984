"""The workload a plan is for: an arrival rate and a sample of (input, output) token lengths.

Lengths come from a trace file (JSONL or CSV with `input_tokens` and `output_tokens` per request) or from a
distribution: a mean and a coefficient of variation, drawn as a lognormal (cv 0: every request at the mean).
A distribution is represented by evenly spaced quantiles, so a plan is deterministic.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

SAMPLE_POINTS = 200
MAX_TRACE_SAMPLE = 4000


class WorkloadError(ValueError):
    """A workload that cannot be used: a bad trace file or impossible parameters."""


@dataclass(frozen=True)
class Workload:
    requests_per_second: float
    requests: tuple[tuple[int, int], ...]  # (input_tokens, output_tokens), equally weighted
    description: str

    def __post_init__(self) -> None:
        if self.requests_per_second <= 0:
            raise WorkloadError(f"requests_per_second must be positive, got {self.requests_per_second}")
        if not self.requests:
            raise WorkloadError("a workload needs at least one request length")

    @property
    def mean_input(self) -> float:
        return sum(i for i, _ in self.requests) / len(self.requests)

    @property
    def mean_output(self) -> float:
        return sum(o for _, o in self.requests) / len(self.requests)

    def input_percentile(self, q: float) -> int:
        return percentile([i for i, _ in self.requests], q)

    def output_percentile(self, q: float) -> int:
        return percentile([o for _, o in self.requests], q)


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def lognormal_quantiles(mean: float, cv: float, points: int = SAMPLE_POINTS) -> list[int]:
    if mean < 1:
        raise WorkloadError(f"a mean length must be at least 1 token, got {mean}")
    if cv < 0:
        raise WorkloadError(f"a coefficient of variation must not be negative, got {cv}")
    if cv == 0:
        return [round(mean)] * points
    sigma = math.sqrt(math.log(1 + cv * cv))
    mu = math.log(mean) - sigma * sigma / 2
    normal = NormalDist()
    return [max(1, round(math.exp(mu + sigma * normal.inv_cdf((k + 0.5) / points)))) for k in range(points)]


def from_distribution(
    requests_per_second: float, mean_input: float, mean_output: float, input_cv: float = 0.0, output_cv: float = 0.0
) -> Workload:
    inputs = lognormal_quantiles(mean_input, input_cv)
    # Pair output quantiles in reverse so long prompts do not all get long answers (neutral pairing).
    outputs = list(reversed(lognormal_quantiles(mean_output, output_cv)))
    desc = f"{requests_per_second:g} req/s, input mean {mean_input:g} (cv {input_cv:g}), output mean {mean_output:g}"
    return Workload(requests_per_second, tuple(zip(inputs, outputs, strict=True)), desc + f" (cv {output_cv:g})")


def from_trace(requests_per_second: float, path: Path) -> Workload:
    rows = _read_trace(path)
    if not rows:
        raise WorkloadError(f"{path}: the trace holds no requests")
    stride = max(1, math.ceil(len(rows) / MAX_TRACE_SAMPLE))
    sample = tuple(rows[::stride])
    description = f"{requests_per_second:g} req/s, lengths from {path} ({len(rows)} requests)"
    return Workload(requests_per_second, sample, description)


def _read_trace(path: Path) -> list[tuple[int, int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read: {exc}") from None
    if path.suffix.lower() == ".csv":
        records: list[tuple[int, object]] = list(enumerate(csv.DictReader(text.splitlines()), start=2))
    else:
        records = []
        for line_no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((line_no, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{path}: line {line_no}: not valid JSON: {exc.msg}") from None
    return [_lengths(path, line_no, record) for line_no, record in records]


def _lengths(path: Path, line_no: int, record: object) -> tuple[int, int]:
    if not isinstance(record, dict):
        raise WorkloadError(f"{path}: line {line_no}: expected an object with input_tokens and output_tokens")
    out: list[int] = []
    for key in ("input_tokens", "output_tokens"):
        value = record.get(key)
        try:
            number = int(str(value))
        except ValueError:
            raise WorkloadError(f"{path}: line {line_no}: {key} must be a positive integer, got {value!r}") from None
        if number < 1:
            raise WorkloadError(f"{path}: line {line_no}: {key} must be a positive integer, got {value!r}")
        out.append(number)
    return out[0], out[1]
