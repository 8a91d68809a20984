"""Output consistency: golden prompts must give the same greedy tokens on the canary as on the baseline.

A release that keeps the model is compared live: each prompt goes to a canary and a baseline server at temperature 0
with a fixed max_tokens, and the token ids must match one for one. A release that changes the model brings its own
golden-outputs file (made with `record`), and the canary is compared with that instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import yaml

from pdstack.canary import client_tls

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a datacenter far away,",
    "1, 2, 3, 5, 8, 13,",
    "Prefill and decode run on different machines because",
)
DEFAULT_MAX_TOKENS = 16


class GoldenError(RuntimeError):
    """An endpoint or a golden file could not be used; the message names which and why."""


class AnswerError(GoldenError):
    """An endpoint answered a golden prompt with an error status: for a canary, that fails the check."""


@dataclass(frozen=True)
class Output:
    prompt: str
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class Comparison:
    prompt: str
    same: bool
    first_difference: int | None
    """Index of the first token that differs (or where one output ends early); None when the outputs match."""
    canary_text: str
    expected_text: str

    def line(self) -> str:
        if self.same:
            return f"SAME {self.prompt!r}"
        return (
            f"DIFFERENT {self.prompt!r} from token {self.first_difference}: "
            f"canary {self.canary_text!r} vs expected {self.expected_text!r}"
        )


@dataclass(frozen=True)
class GoldenReport:
    comparisons: list[Comparison]

    @property
    def passed(self) -> bool:
        return all(c.same for c in self.comparisons)

    def report(self) -> str:
        different = sum(not c.same for c in self.comparisons)
        summary = (
            f"{'PASS' if self.passed else 'FAIL'} golden_outputs: {different} of {len(self.comparisons)} "
            "prompts differ, threshold 0"
        )
        return "\n".join([summary, *(c.line() for c in self.comparisons)])

    def as_json(self) -> dict[str, object]:
        return {
            "outcome": "pass" if self.passed else "fail",
            "comparisons": [asdict(c) for c in self.comparisons],
            "report": self.report(),
        }


def complete(
    url: str,
    prompt: str,
    max_tokens: int,
    *,
    api_key: str | None = None,
    model: str | None = None,
    timeout_s: float = 60.0,
) -> Output:
    """One greedy completion with its token ids (pdserve's and vLLM's `return_token_ids`)."""
    body: dict[str, object] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.post(
            url.rstrip("/") + "/v1/completions",
            json=body,
            headers=headers,
            timeout=timeout_s,
            verify=client_tls.verify(),
        )
    except httpx.HTTPError as exc:
        raise GoldenError(f"{url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise AnswerError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
    choice = response.json()["choices"][0]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise GoldenError(f"{url}: the answer has no choices[0].token_ids (server without return_token_ids)")
    return Output(prompt, [int(t) for t in token_ids], str(choice.get("text", "")))


def generate(
    url: str, prompts: Sequence[str], max_tokens: int, api_key: str | None = None, model: str | None = None
) -> list[Output]:
    return [complete(url, prompt, max_tokens, api_key=api_key, model=model) for prompt in prompts]


def compare(canary: Sequence[Output], expected: Sequence[Output]) -> GoldenReport:
    by_prompt = {o.prompt: o for o in expected}
    comparisons = []
    for out in canary:
        want = by_prompt.get(out.prompt)
        if want is None:
            raise GoldenError(f"prompt {out.prompt!r} has no expected output")
        comparisons.append(
            Comparison(
                out.prompt,
                out.token_ids == want.token_ids,
                _first_difference(out.token_ids, want.token_ids),
                out.text,
                want.text,
            )
        )
    return GoldenReport(comparisons)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class GoldenFile:
    """Prompts and, for a release that changes the model, the outputs its canary must give."""

    max_tokens: int
    prompts: list[str]
    outputs: list[Output] | None = None

    def dump(self, path: Path) -> None:
        document: dict[str, object] = {"max_tokens": self.max_tokens, "prompts": self.prompts}
        if self.outputs is not None:
            document["outputs"] = [asdict(o) for o in self.outputs]
        path.write_text(json.dumps(document, indent=2) + "\n")


def load_golden(path: Path) -> GoldenFile:
    """Read a golden file (JSON or YAML): {max_tokens, prompts, [outputs: [{prompt, token_ids, text}]]}."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise GoldenError(f"{path}: cannot read ({exc})") from exc
    if not isinstance(document, dict):
        raise GoldenError(f"{path}: expected a mapping with max_tokens and prompts")
    max_tokens = document.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise GoldenError(f"{path}: max_tokens must be a positive integer, got {max_tokens!r}")
    prompts = document.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise GoldenError(f"{path}: prompts must be a non-empty list of non-empty strings")
    outputs = None
    if "outputs" in document:
        try:
            outputs = [
                Output(str(o["prompt"]), [int(t) for t in o["token_ids"]], str(o.get("text", "")))
                for o in document["outputs"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise GoldenError(f"{path}: outputs: each needs prompt and token_ids ({exc})") from exc
        missing = set(prompts) - {o.prompt for o in outputs}
        if missing:
            raise GoldenError(f"{path}: outputs: no output for prompt {sorted(missing)[0]!r}")
    return GoldenFile(max_tokens, prompts, outputs)
