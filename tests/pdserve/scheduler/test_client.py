"""The heartbeat client servers run: registers, reports load, re-registers after a scheduler restart, deregisters."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from pdserve.scheduler.client import drain, run_heartbeats
from pdserve.scheduler.protocol import InstanceInfo, InstanceLoad
from tests.support.services import instance_token_file, principal_token, start_scheduler

INFO = InstanceInfo(instance_id="decode-x", role="decode", version="v1", kv_fingerprint="fp", url="http://127.0.0.1:9")


async def wait_until(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(check):  # type: ignore[arg-type]
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


@pytest.mark.slow  # a scheduler process, restarted
def test_heartbeats_survive_scheduler_restart_and_deregister_on_cancel(tmp_path: Path) -> None:
    service, _ = start_scheduler(tmp_path, missed=50)  # dead only after 10 s: a stall must not flap the instance
    token = instance_token_file(tmp_path, "decode-x").read_text().strip()
    reader = {"Authorization": "Bearer " + principal_token(tmp_path, "gateway")}
    active = {"n": 0}

    def load() -> InstanceLoad:
        active["n"] += 1
        return InstanceLoad(active_requests=active["n"], max_concurrency=1000)

    def routed() -> list[dict[str, object]]:
        instances: list[dict[str, object]] = httpx.get(f"{service.url}/v1/routing", headers=reader).json()["instances"]
        return instances

    async def scenario() -> None:
        task = asyncio.create_task(run_heartbeats(service.url, INFO, load, token=token, interval=0.05))
        await wait_until(lambda: len(routed()) == 1 and routed()[0]["load"]["active_requests"] > 1)  # type: ignore[index]
        await asyncio.to_thread(service.kill)
        await asyncio.to_thread(service.start)  # same port, empty registry
        await wait_until(lambda: [i["instance_id"] for i in routed()] == ["decode-x"])
        assert not await drain(service.url, "decode-x", "not-the-token")
        assert not await drain(service.url, "decode-x", principal_token(tmp_path, "instance:decode-y"))
        assert await drain(service.url, "decode-x", token)
        await wait_until(lambda: routed() == [])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        listed = httpx.get(f"{service.url}/v1/instances", headers=reader).json()["instances"]
        assert listed == [], "cancelling the heartbeat task must deregister the instance"

    try:
        asyncio.run(scenario())
    finally:
        service.stop()
