"""Continuous batching: one engine step at a time over every admitted sequence.

Each step the scheduler gives every decoding sequence one token and fills the rest of `prefill_token_budget` with
prompt chunks, shortest remaining prompt (by power-of-two length bucket) first, so one long prompt is fed in chunks
beside the short ones instead of stalling them. Sequences join and leave the batch between any two steps.

How the first token is made: a sequence's prefill covers prompt[:-1]; its last prompt token is fed as its first
decode step, whose logits give the first generated token. Prefill ships the KV of prompt[:-1] (a hook runs just
before that first decode step), so decode's first step is exactly the step colocated runs, and PD output equals
colocated output (for seeded sampling too, as decode's sampler draws every token).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine import Engine, KVCache, RequestState, TokenOutput
from pdserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)
MIN_PREFILL_TOKENS = 16  # prompt tokens a step always admits, however many sequences are decoding

ExportHook = Callable[["Sequence"], None]
_arrivals = itertools.count()


class CapacityError(Exception):
    """A request refused because the server is full: 429 for concurrency, 503 for KV memory."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    state: RequestState
    cache: KVCache
    arrived_at: float = field(default_factory=time.perf_counter)
    export: ExportHook | None = None  # prefill role: ships the KV of prompt[:-1]
    outputs: asyncio.Queue[TokenOutput | BaseException] = field(default_factory=asyncio.Queue)
    aborted: bool = False
    order: int = field(default_factory=lambda: next(_arrivals))
    last_token_at: float | None = None
    scheduled: bool = False  # in at least one step's plan: "running" in vLLM's sense, no longer waiting

    @property
    def prefill_end(self) -> int:
        return len(self.prompt_ids) - 1

    @property
    def decoding(self) -> bool:
        return self.cache.position >= self.prefill_end

    @property
    def pending_prompt(self) -> int:
        return max(self.prefill_end - self.cache.position, 0)

    def next_decode_input(self) -> int:
        return self.state.token_ids[-1] if self.state.token_ids else self.prompt_ids[-1]


@dataclass
class StepPlan:
    decodes: list[Sequence]
    prefills: list[tuple[Sequence, int]]  # (sequence, chunk length)

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


def length_bucket(tokens: int) -> int:
    return max(tokens - 1, 0).bit_length()


class Admission:
    """Counts admitted requests and the KV memory they may grow to; refuses what would not fit."""

    def __init__(self, max_num_seqs: int, kv_memory_bytes: int, metrics: ServerMetrics) -> None:
        self.max_num_seqs = max_num_seqs
        self.kv_memory_bytes = kv_memory_bytes
        self.requests = 0
        self.reserved = 0
        self._held: set[Reservation] = set()
        self._metrics = metrics
        metrics.kv_limit.set(kv_memory_bytes)

    def reserve(self, nbytes: int) -> Reservation:
        """A slot and `nbytes` of KV memory, held until the Reservation is released (raises CapacityError)."""
        if self.requests >= self.max_num_seqs:
            self._metrics.rejected.labels("concurrency").inc()
            raise CapacityError(
                429,
                "concurrency",
                f"server busy: {self.requests} of {self.max_num_seqs} requests admitted; retry later",
            )
        if self.reserved + nbytes > self.kv_memory_bytes:
            self._metrics.rejected.labels("kv_memory").inc()
            raise CapacityError(
                503,
                "kv_memory",
                f"KV memory full: this request needs {nbytes} bytes, "
                f"{self.kv_memory_bytes - self.reserved} of {self.kv_memory_bytes} are free",
            )
        self.requests += 1
        self.reserved += nbytes
        self._publish()
        reservation = Reservation(self, nbytes)
        self._held.add(reservation)
        return reservation

    def give_back(self, reservation: Reservation) -> None:
        self._held.discard(reservation)
        self.requests -= 1
        self.reserved -= reservation.nbytes
        self._publish()

    def _publish(self) -> None:
        self._metrics.admitted.set(self.requests)
        self._metrics.kv_reserved.set(self.reserved)

    @property
    def waiting(self) -> int:
        """Admitted requests whose sequence has not been in an engine step yet (vLLM's "waiting")."""
        return sum(1 for r in self._held if r.sequence is None or not r.sequence.scheduled)

    @property
    def usage(self) -> float:
        """Reserved over available KV memory: what admission refuses on, so 1.0 means the next request is refused."""
        return self.reserved / self.kv_memory_bytes if self.kv_memory_bytes > 0 else 1.0


class Reservation:
    """One admitted request's slot and KV memory. Released exactly once however often `release` is called.

    As a context manager it releases when the block raises (whatever raised: RNG setup, a KV pull, a cancellation),
    and otherwise stays held by whoever the block handed it to (a Generation, released by its close)."""

    def __init__(self, admission: Admission, nbytes: int) -> None:
        self.nbytes = nbytes
        self.sequence: Sequence | None = None  # set once the request's sequence exists (it waits until scheduled)
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            admission, self._admission = self._admission, None
            admission.give_back(self)

    @property
    def held(self) -> bool:
        return self._admission is not None

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self.release()


class BatchScheduler:
    """Owns the engine: forms each step's batch on the event loop, runs the step in a worker thread."""

    def __init__(self, engine: Engine, prefill_token_budget: int, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.prefill_token_budget = prefill_token_budget
        self.metrics = metrics
        self._active: list[Sequence] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def add(self, sequence: Sequence) -> None:
        self._active.append(sequence)
        self._wakeup.set()

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def outstanding_prompt_tokens(self) -> int:
        return sum(s.pending_prompt for s in self._active)

    def plan(self) -> StepPlan:
        """This step's batch: every decoding sequence, then prompt chunks within the token budget, shortest
        remaining prompt first; the oldest waiting prompt always gets a chunk, so short ones cannot starve it."""
        self._active = [s for s in self._active if not (s.aborted or s.state.finished)]
        decodes = [s for s in self._active if s.decoding]
        budget = max(self.prefill_token_budget - len(decodes), MIN_PREFILL_TOKENS)
        waiting = [s for s in self._active if not s.decoding]
        for sequence in decodes:
            sequence.scheduled = True
        if not waiting:
            return StepPlan(decodes, [])
        oldest = min(waiting, key=lambda s: s.order)
        chunks = {oldest: min(oldest.pending_prompt, MIN_PREFILL_TOKENS)}
        budget -= chunks[oldest]
        for sequence in sorted(waiting, key=lambda s: (length_bucket(s.pending_prompt), s.order)):
            if budget <= 0:
                break
            extra = min(sequence.pending_prompt - chunks.get(sequence, 0), budget)
            if extra > 0:
                chunks[sequence] = chunks.get(sequence, 0) + extra
                budget -= extra
        for sequence in chunks:
            sequence.scheduled = True
        return StepPlan(decodes, list(chunks.items()))

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            plan = self.plan()
            self.metrics.running.set(len(self._active))
            if not plan.decodes and not plan.prefills:
                self._wakeup.clear()
                continue
            started = time.perf_counter()
            try:
                events = await asyncio.to_thread(self.execute, plan)
            except Exception as error:  # an engine fault fails this step's requests, not the server
                log.exception("engine step failed")
                events = [(s, error) for s in [*plan.decodes, *(s for s, _ in plan.prefills)]]
            self._observe_step(plan, time.perf_counter() - started)
            for sequence, event in events:
                sequence.outputs.put_nowait(event)
                if isinstance(event, BaseException):
                    sequence.aborted = True

    def execute(self, plan: StepPlan) -> list[tuple[Sequence, TokenOutput | BaseException]]:
        """One engine step (worker thread): export hooks, one batched forward, then sampling."""
        events: list[tuple[Sequence, TokenOutput | BaseException]] = []
        decodes: list[Sequence] = []
        for sequence in plan.decodes:
            if sequence.export is not None:
                hook, sequence.export = sequence.export, None
                try:
                    hook(sequence)
                except Exception as error:
                    events.append((sequence, error))
                    continue
            decodes.append(sequence)
        batch: list[tuple[list[int], KVCache]] = [([s.next_decode_input()], s.cache) for s in decodes]
        for sequence, length in plan.prefills:
            start = sequence.cache.position
            batch.append((sequence.prompt_ids[start : start + length], sequence.cache))
        if not batch:
            return events
        logits = self.engine.forward(batch)
        now = time.perf_counter()
        for row, sequence in enumerate(decodes):
            output = sequence.state.step(logits[row])
            self._observe_token(sequence, now)
            events.append((sequence, output))
        return events

    def _observe_token(self, sequence: Sequence, now: float) -> None:
        if sequence.last_token_at is None:
            self.metrics.ttft.observe(now - sequence.arrived_at)
        else:
            self.metrics.inter_token.observe(now - sequence.last_token_at)
        sequence.last_token_at = now
        self.metrics.generation_tokens.inc()
        if sequence.state.finished:
            self.metrics.e2e.observe(now - sequence.arrived_at)

    def _observe_step(self, plan: StepPlan, seconds: float) -> None:
        self.metrics.step_batch.observe(len(plan.decodes) + len(plan.prefills))
        self.metrics.step_tokens.observe(plan.tokens)
        self.metrics.step_seconds.observe(seconds)
