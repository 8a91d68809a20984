"""Drive load: open loop (arrivals on schedule, never waiting for answers) and closed loop (for the peak probe)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from pdstack.bench.client import OVERLOAD, RequestResult, request_body, send_request
from pdstack.bench.endpoint import Endpoint
from pdstack.bench.workload import Prompt

OnDone = Callable[[RequestResult], None]


@dataclass(frozen=True)
class LoadSettings:
    """What every request of a run shares."""

    max_tokens: int
    ignore_eos: bool
    timeout_s: float
    max_in_flight: int


class LagMonitor:
    """How late the load generator's own event loop runs: a ticker that asks to wake every `tick_s` and records how
    much later it woke. A busy client host delays every timestamp by about this much."""

    def __init__(self, tick_s: float = 0.01) -> None:
        self.tick_s = tick_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.tick_s)
            self.lags.append(max(0.0, time.perf_counter() - asked - self.tick_s))

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick())

    def stop(self) -> list[float]:
        if self._task is not None:
            self._task.cancel()
        return self.lags


async def warm_up(endpoint: Endpoint, prompts: Sequence[Prompt], settings: LoadSettings) -> list[RequestResult]:
    """Requests sent one by one before measuring, so first-use costs (imports, lazy server set-up) stay out."""
    results = []
    async with _client(endpoint, settings) as client:
        for index, prompt in enumerate(prompts):
            body = request_body(endpoint, prompt.text, settings.max_tokens, settings.ignore_eos)
            result = RequestResult(index, 0.0, 0.0, prompt.kind)
            results.append(await send_request(client, endpoint, body, result, settings.timeout_s))
    return results


def _client(endpoint: Endpoint, settings: LoadSettings) -> httpx.AsyncClient:
    # The pool is as large as the in-flight cap, so requests never queue silently inside the client.
    limits = httpx.Limits(max_connections=settings.max_in_flight, max_keepalive_connections=settings.max_in_flight)
    timeout = httpx.Timeout(settings.timeout_s, connect=min(settings.timeout_s, 10.0))
    return httpx.AsyncClient(base_url=endpoint.base_url, limits=limits, timeout=timeout)


async def run_open_loop(
    endpoint: Endpoint,
    prompts: Sequence[Prompt],
    arrivals: Sequence[float],
    settings: LoadSettings,
    *,
    on_done: OnDone | None = None,
    lag: LagMonitor | None = None,
) -> list[RequestResult]:
    """Launch request i at arrivals[i] seconds from the start, whatever is still in flight.

    A request that would exceed `max_in_flight` is not sent and counts as an `overload` error, so the offered load
    is never silently lowered.
    """
    if len(prompts) < len(arrivals):
        raise ValueError(f"{len(arrivals)} arrivals but only {len(prompts)} prompts")
    results: list[RequestResult] = []
    tasks: set[asyncio.Task[RequestResult]] = set()

    def finished(task: asyncio.Task[RequestResult]) -> None:
        tasks.discard(task)
        if on_done is not None and not task.cancelled():
            on_done(task.result())

    async with _client(endpoint, settings) as client:
        if lag is not None:
            lag.start()
        t0 = time.perf_counter()
        for index, (at, prompt) in enumerate(zip(arrivals, prompts, strict=False)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result = RequestResult(index, scheduled_s=at, start_s=time.perf_counter() - t0, prompt_kind=prompt.kind)
            results.append(result)
            if len(tasks) >= settings.max_in_flight:
                result.error, result.detail = OVERLOAD, f"{len(tasks)} requests already in flight"
                if on_done is not None:
                    on_done(result)
                continue
            body = request_body(endpoint, prompt.text, settings.max_tokens, settings.ignore_eos)
            task = asyncio.create_task(send_request(client, endpoint, body, result, settings.timeout_s))
            tasks.add(task)
            task.add_done_callback(finished)
        if tasks:
            await asyncio.gather(*tasks)
        if lag is not None:
            lag.stop()
    return results


async def run_closed_loop(
    endpoint: Endpoint,
    prompts: Sequence[Prompt],
    concurrency: int,
    duration_s: float,
    settings: LoadSettings,
) -> tuple[list[RequestResult], float]:
    """`concurrency` workers each send their next request as soon as the last one answers, for `duration_s`.

    Prompts are used in turn and reused from the first when they run out.

    Returns the results and the elapsed time from the start to the last answer.
    """
    if not prompts:
        raise ValueError("closed loop needs at least one prompt")
    results: list[RequestResult] = []

    async def worker(client: httpx.AsyncClient, t0: float) -> None:
        while time.perf_counter() - t0 < duration_s:
            index = len(results)
            prompt = prompts[index % len(prompts)]
            now = time.perf_counter() - t0
            result = RequestResult(index, scheduled_s=now, start_s=now, prompt_kind=prompt.kind)
            results.append(result)
            body = request_body(endpoint, prompt.text, settings.max_tokens, settings.ignore_eos)
            await send_request(client, endpoint, body, result, settings.timeout_s)

    async with _client(endpoint, settings) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client, t0) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return results, elapsed
