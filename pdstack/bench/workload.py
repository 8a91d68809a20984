"""Seeded synthetic prompts with short, long and mixed length distributions.

The endpoint's tokenizer is unknown, so prompts are built from common English words and their length is set in words
(roughly one token each for most tokenizers); the results report the token counts the server itself returns in `usage`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "had",
    "not",
    "but",
    "first",
    "one",
    "their",
    "its",
    "new",
    "after",
    "who",
    "they",
    "have",
    "has",
    "been",
    "also",
    "into",
    "other",
    "two",
    "more",
    "than",
    "over",
    "time",
    "city",
    "year",
    "between",
    "under",
    "while",
    "later",
    "where",
    "during",
    "about",
    "world",
    "state",
    "part",
    "made",
    "most",
    "some",
    "many",
    "school",
    "only",
    "three",
    "both",
    "group",
    "water",
    "river",
    "music",
    "line",
    "house",
    "power",
    "light",
    "family",
    "system",
    "number",
    "people",
    "country",
    "history",
    "market",
    "small",
    "large",
    "early",
    "north",
    "south",
    "east",
    "west",
    "since",
    "through",
    "until",
    "around",
    "place",
    "name",
    "found",
    "known",
    "used",
    "work",
    "team",
    "game",
    "play",
    "road",
    "field",
    "station",
    "church",
    "college",
    "bridge",
    "island",
    "garden",
    "village",
    "forest",
    "mountain",
    "company",
    "science",
    "paper",
    "letter",
    "story",
    "model",
    "engine",
    "signal",
    "network",
    "server",
    "window",
    "memory",
    "token",
    "answer",
    "question",
)


@dataclass(frozen=True)
class LengthRange:
    """Prompt lengths in words, drawn uniformly from [low, high]."""

    low: int
    high: int


SHORT = LengthRange(32, 128)
LONG = LengthRange(512, 2048)
# share of long prompts in the mixed workload: most chat traffic is short, a tail of long documents
MIXED_LONG_SHARE = 0.3
WORKLOADS = ("short", "long", "mixed")


class BenchWorkloadError(ValueError):
    """A workload was asked for that does not exist."""


@dataclass(frozen=True)
class Prompt:
    """One synthetic prompt and the length class it was drawn from."""

    text: str
    words: int
    kind: str


def _length_range(workload: str, rng: np.random.Generator) -> tuple[str, LengthRange]:
    if workload == "short":
        return "short", SHORT
    if workload == "long":
        return "long", LONG
    if workload == "mixed":
        return ("long", LONG) if rng.random() < MIXED_LONG_SHARE else ("short", SHORT)
    raise BenchWorkloadError(f"workload: unknown {workload!r}, expected one of {', '.join(WORKLOADS)}")


def make_prompts(workload: str, count: int, seed: int) -> list[Prompt]:
    """`count` prompts of the workload's length distribution; the same seed gives the same prompts."""
    if workload not in WORKLOADS:
        raise BenchWorkloadError(f"workload: unknown {workload!r}, expected one of {', '.join(WORKLOADS)}")
    rng = np.random.default_rng(seed)
    prompts = []
    for index in range(count):
        kind, lengths = _length_range(workload, rng)
        words = int(rng.integers(lengths.low, lengths.high + 1))
        picked = rng.choice(len(WORDS), size=words)
        # a distinct two-word opening per request keeps servers with prefix caching from reusing earlier prompts
        body = " ".join(WORDS[i] for i in picked[2:])
        text = f"Request {index}: {body}"
        prompts.append(Prompt(text=text, words=words, kind=kind))
    return prompts
