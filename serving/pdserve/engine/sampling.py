"""Sampling parameters, the per-request sampler, and per-request generation state (stop handling, streaming).

Sampling order: temperature, then top-k, then top-p (nucleus), then one draw from the request's own
``numpy.random.Generator`` (PCG64 seeded with ``seed``), so a request with a seed is reproducible whatever else
runs in the same batch. ``temperature == 0`` is greedy (argmax, lowest id on ties).

Stop strings are matched on the detokenised text; the text returned excludes the stop string (OpenAI semantics),
and while streaming, text that might be the start of a stop string is held back until it is not. Matching is
incremental (one Knuth-Morris-Pratt state per stop string, advanced by each new character), so its cost is linear in
the generated text whatever the stop strings: this runs on the engine thread every request shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None = fresh entropy per request
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # tokens generated before EOS, stop_token_ids or a stop string may end the request (vLLM's)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """Turns one logits row into a token id, with the request's own random stream."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: npt.NDArray[np.floating]) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < scaled.shape[-1]:
            kth = np.partition(scaled, -p.top_k)[-p.top_k]
            scaled = np.where(scaled >= kth, scaled, -np.inf)
        probs = np.exp(scaled - np.max(scaled))
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        if p.top_p < 1.0:
            cumulative = np.cumsum(sorted_probs)
            # keep every token whose preceding mass is below top_p (so at least one, and the one crossing it)
            keep = (cumulative - sorted_probs) < p.top_p
            sorted_probs = np.where(keep, sorted_probs, 0.0)
        cumulative = np.cumsum(sorted_probs)
        u = self.rng.random() * cumulative[-1]
        index = int(np.searchsorted(cumulative, u, side="right"))
        return int(order[min(index, len(order) - 1)])


class StopMatcher:
    """Where stop strings occur in a text fed to it piece by piece: for each stop string, the longest prefix of it
    that ends the text so far (its KMP state), advanced in amortised O(1) per character."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._fail = [_failure(stop) for stop in self.stops]
        self._state = [0] * len(self.stops)
        self.fed = 0  # characters fed so far

    def feed(self, text: str) -> int | None:
        """Advance over `text`; the earliest start (an index into the whole text) of a stop string completed in it,
        or None."""
        earliest: int | None = None
        for char in text:
            self.fed += 1
            for index, stop in enumerate(self.stops):
                state, fail = self._state[index], self._fail[index]
                while state and stop[state] != char:
                    state = fail[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):
                    start = self.fed - state
                    earliest = start if earliest is None else min(earliest, start)
                    state = fail[state - 1]
                self._state[index] = state
        return earliest

    def held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return max(self._state, default=0)


def _failure(pattern: str) -> list[int]:
    """KMP's failure function: for each prefix, the length of its longest proper prefix that is also its suffix."""
    fail = [0] * len(pattern)
    length = 0
    for index in range(1, len(pattern)):
        while length and pattern[index] != pattern[length]:
            length = fail[length - 1]
        if pattern[index] == pattern[length]:
            length += 1
        fail[index] = length
    return fail


@dataclass
class TokenOutput:
    """What one generated token produced."""

    token_id: int
    text: str  # text that became safe to emit with this token (may be "")
    finished: bool
    finish_reason: FinishReason | None


@dataclass
class RequestState:
    """Generation state of one request: sampler, detokeniser, stop matching, streamed text.

    A server calls ``sample(logits)`` then ``append(token)`` per step (or ``step(logits)`` for both), stops
    scheduling the request once ``finished``, and streams each ``TokenOutput.text``.
    """

    tokenizer: Tokenizer
    prompt_ids: Sequence[int]
    params: SamplingParams
    eos_token_ids: Sequence[int] = ()
    max_total_tokens: int | None = None  # model context limit (prompt + generated)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text so far, stop string excluded
    finished: bool = False
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)
        self._detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self._emitted = 0
        self._stops = StopMatcher(self.params.stop)
        self._stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            self._stop_ids.update(int(t) for t in self.eos_token_ids)

    def sample(self, logits: npt.NDArray[np.floating]) -> int:
        if len(self.token_ids) < self.params.min_tokens and self._stop_ids:
            logits = logits.copy()
            logits[[t for t in self._stop_ids if 0 <= t < logits.shape[-1]]] = -np.inf
        return self.sampler.sample(logits)

    def step(self, logits: npt.NDArray[np.floating]) -> TokenOutput:
        return self.append(self.sample(logits))

    def append(self, token_id: int) -> TokenOutput:
        if self.finished:
            raise RuntimeError("request already finished")
        token_id = int(token_id)
        self.token_ids.append(token_id)
        may_stop = len(self.token_ids) >= self.params.min_tokens
        if may_stop and token_id in self._stop_ids:
            self.text += self._detok.flush()
            return self._finish(token_id, "stop")
        hit = self._extend(self._detok.push(token_id))
        if may_stop and hit is not None:
            return self._stop_at(token_id, hit)
        if len(self.token_ids) >= self.params.max_tokens or (
            self.max_total_tokens is not None and len(self.prompt_ids) + len(self.token_ids) >= self.max_total_tokens
        ):
            hit = self._extend(self._detok.flush())
            if may_stop and hit is not None:
                return self._stop_at(token_id, hit)
            return self._finish(token_id, "length")
        safe = len(self.text) - self._stops.held_back()
        delta = self.text[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return TokenOutput(token_id, delta, False, None)

    def _extend(self, piece: str) -> int | None:
        """Append `piece` to the text; where a stop string completed in it starts, if one did."""
        self.text += piece
        return self._stops.feed(piece)

    def _stop_at(self, token_id: int, hit: int) -> TokenOutput:
        self.text = self.text[:hit]
        return self._finish(token_id, "stop")

    def _finish(self, token_id: int, reason: FinishReason) -> TokenOutput:
        self.finished = True
        self.finish_reason = reason
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return TokenOutput(token_id, delta, True, reason)
