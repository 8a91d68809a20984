"""Sampling parameters, the per-request sampler, and per-request generation state (stop handling, streaming).

Sampling order: temperature, then top-k, then top-p (nucleus), then one draw from the request's own
``numpy.random.Generator`` (PCG64 seeded with ``seed``), so a request with a seed is reproducible whatever else
runs in the same batch. ``temperature == 0`` is greedy (argmax, lowest id on ties).

Stop strings are matched on the detokenised text; the text returned excludes the stop string (OpenAI semantics),
and while streaming, text that might be the start of a stop string is held back until it is not.
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
        search_from = max(0, len(self.text) - self._longest_stop() + 1)
        self.text += self._detok.push(token_id)
        if may_stop and self.params.stop:
            hit = self._find_stop(search_from)
            if hit is not None:
                self.text = self.text[:hit]
                return self._finish(token_id, "stop")
        if len(self.token_ids) >= self.params.max_tokens or (
            self.max_total_tokens is not None and len(self.prompt_ids) + len(self.token_ids) >= self.max_total_tokens
        ):
            self.text += self._detok.flush()
            hit = self._find_stop(search_from) if self.params.stop else None
            if hit is not None:
                self.text = self.text[:hit]
                return self._finish(token_id, "stop")
            return self._finish(token_id, "length")
        safe = len(self.text) - self._held_back()
        delta = self.text[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return TokenOutput(token_id, delta, False, None)

    def _finish(self, token_id: int, reason: FinishReason) -> TokenOutput:
        self.finished = True
        self.finish_reason = reason
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return TokenOutput(token_id, delta, True, reason)

    def _longest_stop(self) -> int:
        return max((len(s) for s in self.params.stop), default=1)

    def _find_stop(self, start: int) -> int | None:
        hits = [i for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
