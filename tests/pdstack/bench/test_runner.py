"""Open loop: arrivals never wait for answers, and the in-flight cap turns excess arrivals into `overload` errors."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pdstack.bench import runner
from pdstack.bench.client import OVERLOAD, RequestResult
from pdstack.bench.endpoint import Endpoint
from pdstack.bench.runner import LoadSettings, run_open_loop
from pdstack.bench.workload import make_prompts

ENDPOINT = Endpoint("http://bench.test/v1", "chat", "tiny")
ANSWER = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n'


def test_arrivals_go_out_while_earlier_requests_are_unanswered(monkeypatch: pytest.MonkeyPatch) -> None:
    """No request is answered until the cap is full and the rest have arrived; so arrivals cannot have waited."""
    cap, count = 3, 10
    in_flight: list[str] = []
    overloads: list[RequestResult] = []

    async def run() -> list[RequestResult]:
        release = asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            in_flight.append(json.loads(request.content)["messages"][0]["content"])
            await release.wait()
            return httpx.Response(200, content=ANSWER)

        def on_done(result: RequestResult) -> None:
            if result.error == OVERLOAD:
                overloads.append(result)
            if len(overloads) == count - cap:
                release.set()

        def mocked(endpoint: Endpoint, settings: LoadSettings) -> httpx.AsyncClient:
            return httpx.AsyncClient(base_url=endpoint.base_url, transport=httpx.MockTransport(handler))

        monkeypatch.setattr(runner, "_client", mocked)
        settings = LoadSettings(max_tokens=4, ignore_eos=False, timeout_s=10.0, max_in_flight=cap)
        arrivals = [0.01 * i for i in range(count)]
        return await run_open_loop(ENDPOINT, make_prompts("short", count, seed=0), arrivals, settings, on_done=on_done)

    results = asyncio.run(run())
    assert [r.index for r in results] == list(range(count))
    assert len(in_flight) == cap
    assert [r.ok for r in results] == [True] * cap + [False] * (count - cap)
    assert {r.error for r in results[cap:]} == {OVERLOAD}
    assert all(r.scheduled_s == pytest.approx(0.01 * r.index) for r in results)
    assert all(r.start_s >= r.scheduled_s for r in results)


def test_more_arrivals_than_prompts_is_refused() -> None:
    settings = LoadSettings(max_tokens=4, ignore_eos=False, timeout_s=1.0, max_in_flight=1)
    with pytest.raises(ValueError, match="3 arrivals but only 1 prompts"):
        asyncio.run(run_open_loop(ENDPOINT, make_prompts("short", 1, 0), [0.1, 0.2, 0.3], settings))


def test_the_lag_monitor_sees_a_blocked_event_loop() -> None:
    async def run() -> list[float]:
        monitor = runner.LagMonitor(tick_s=0.005)
        monitor.start()
        await asyncio.sleep(0.02)
        time.sleep(0.2)  # the loop is blocked: every timestamp the client takes now is late
        await asyncio.sleep(0.02)
        return monitor.stop()

    lags = asyncio.run(run())
    # a blocked loop shows as one lag about as long as the block; compared with the block itself, not a clock budget
    assert max(lags) >= 0.2 * 0.9
    assert sorted(lags)[len(lags) // 2] < max(lags) / 2
