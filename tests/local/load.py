"""Continuous client load against the local gateway while a test deploys, kills or degrades something.

Requests go out open-loop at a fixed rate (the arrival of one never waits for another), each a streamed completion
sent and checked by `pdstack bench`'s own client, so every failure carries the cause a user would see.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from pdstack.bench.client import EMPTY_ANSWER, RequestResult, request_body, send_request
from pdstack.bench.endpoint import Endpoint

# Past the local stack's offload threshold (32 tokens), so these take the prefill -> KV over the WAN -> decode path:
# about 150 tokens of the local checkpoints' word-level vocabulary, as many as their earlier BPE made of 3 repeats.
LONG_PROMPT = "Prefill runs in one datacenter and the decode in the other, the KV cache crosses the link; " * 8
SHORT_PROMPT = "Hello"


@dataclass
class ClientLoad:
    endpoint: Endpoint
    rate_per_s: float = 4.0
    max_tokens: int = 12
    timeout_s: float = 60.0
    results: list[RequestResult] = field(default_factory=list)
    started_at: float = 0.0  # time.perf_counter() when the first request went out; results' start_s count from it
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> ClientLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[RequestResult]:
        """Stop sending and wait for every request in flight to finish (each is bounded by its timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 30)
            assert not self._thread.is_alive(), "requests still hanging past their timeout"
        return self.results

    async def _run(self) -> None:
        started = self.started_at = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=self.endpoint.base_url, limits=limits, timeout=self.timeout_s) as client:
            index = 0
            while not self._stop.is_set():
                prompt, kind = (LONG_PROMPT, "long") if index % 4 else (SHORT_PROMPT, "short")
                result = RequestResult(index, index / self.rate_per_s, time.perf_counter() - started, kind)
                body = request_body(self.endpoint, f"{index} {prompt}", self.max_tokens, ignore_eos=True)
                tasks.append(asyncio.create_task(send_request(client, self.endpoint, body, result, self.timeout_s)))
                self.results.append(result)
                index += 1
                await asyncio.sleep(max(0.0, started + index / self.rate_per_s - time.perf_counter()))
            await asyncio.gather(*tasks)

    def failures(self) -> Counter[str]:
        """Requests that failed. Not answers without text: a greedy answer of only <unk>, <s> or </s> tokens renders
        as nothing, from the engine directly as well."""
        return Counter(f"{r.error}: {r.detail}" for r in self.results if r.error not in (None, EMPTY_ANSWER))

    def completed(self) -> int:
        return sum(r.ok for r in self.results)
