"""What a prefill/decode/colocated server runs to register with the scheduler and heartbeat.

    info = InstanceInfo(role="decode", version="v1", kv_fingerprint=engine.fingerprint,
                        url="http://10.0.0.5:8100", model="tiny", instance_id="decode-a")
    task = asyncio.create_task(run_heartbeats(scheduler_url, info, load_fn, token=instance_token, interval=2.0))
    ...
    await drain(scheduler_url, info.instance_id, instance_token)  # on SIGTERM: stop new traffic, finish in-flight
    task.cancel()                                                 # cancelling deregisters the instance

`instance_token` is this instance's own principal token, `pdserve.scheduler.identity.derive_token(key,
"instance:" + instance_id)` (every call presents it as a bearer token); the scheduler accepts it only for that id,
so `instance_id` is required. `load_fn` returns an
InstanceLoad (or a dict of its fields), sync or async; `ready=False` keeps the instance out of the routing table.
The loop never raises on scheduler trouble: it logs, retries, and registers again when the scheduler forgot the
instance (404 after a scheduler restart).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from .protocol import InstanceInfo, InstanceLoad

log = logging.getLogger(__name__)

LoadFn = Callable[[], InstanceLoad | dict[str, Any] | Awaitable[InstanceLoad | dict[str, Any]]]
TIMEOUT = httpx.Timeout(5.0, connect=2.0)
# Below the scheduler's (uvicorn's) 5 s keep-alive timeout, so a heartbeat never goes out on a connection the
# scheduler is closing at that moment.
LIMITS = httpx.Limits(keepalive_expiry=3.0)


async def run_heartbeats(
    scheduler_url: str,
    instance_info: InstanceInfo | dict[str, Any],
    load_fn: LoadFn,
    *,
    token: str,
    interval: float = 2.0,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Register, then send a heartbeat with the current load every `interval` seconds until cancelled. `verify`
    is what an https scheduler is checked against (pdserve.common.tls.client_context)."""
    info = InstanceInfo.model_validate(instance_info)
    if info.instance_id is None:
        raise ValueError("instance_id: required, the scheduler accepts the token only for the id it was derived for")
    base = scheduler_url.rstrip("/")
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS, headers=bearer(token), verify=verify) as client:
        try:
            registered = False
            while True:
                if not registered:
                    registered = await _register(client, base, info)
                if registered:
                    registered = await _heartbeat(client, base, info, await _current_load(load_fn))
                await asyncio.sleep(interval)
        finally:
            await asyncio.shield(_deregister(client, base, str(info.instance_id)))


async def drain(scheduler_url: str, instance_id: str, token: str, verify: ssl.SSLContext | bool = True) -> bool:
    """Ask the scheduler to route no new requests to this instance; True if it acknowledged."""
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS, headers=bearer(token), verify=verify) as client:
        try:
            response = await client.post(f"{scheduler_url.rstrip('/')}/v1/instances/{instance_id}/drain")
        except httpx.HTTPError as exc:
            log.warning("drain failed", extra={"fields": {"cause": type(exc).__name__}})
            return False
    return response.status_code == 200


def read_token(path: Path, field: str) -> str:
    """A bearer token from its secret file; a missing, unreadable or empty file is a ValueError naming `field`."""
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"{field} {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"{field} {path} is empty")
    return token


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _current_load(load_fn: LoadFn) -> InstanceLoad:
    value = load_fn()
    if inspect.isawaitable(value):
        value = await value
    return InstanceLoad.model_validate(value)


async def _register(client: httpx.AsyncClient, base: str, info: InstanceInfo) -> bool:
    try:
        response = await client.post(f"{base}/v1/instances", json=info.model_dump())
    except httpx.HTTPError as exc:
        log.warning("scheduler unreachable", extra={"fields": {"cause": type(exc).__name__, "scheduler": base}})
        return False
    if response.status_code != 201:
        log.error("registration refused", extra={"fields": {"status": response.status_code, "body": response.text}})
        return False
    log.info("registered with scheduler", extra={"fields": {"instance_id": info.instance_id, "scheduler": base}})
    return True


async def _heartbeat(client: httpx.AsyncClient, base: str, info: InstanceInfo, load: InstanceLoad) -> bool:
    """Send one heartbeat; False means the scheduler does not know us and we must register again."""
    try:
        response = await client.post(
            f"{base}/v1/instances/{info.instance_id}/heartbeat", json={"load": load.model_dump()}
        )
    except httpx.HTTPError as exc:
        log.warning("heartbeat failed", extra={"fields": {"cause": type(exc).__name__}})
        return True
    if response.status_code == 404:
        log.info("scheduler forgot this instance; registering again")
        return False
    if response.status_code in (401, 403):
        log.error(
            "heartbeat refused: the scheduler does not accept this token for this instance",
            extra={"fields": {"status": response.status_code, "instance_id": info.instance_id}},
        )
        return False
    return True


async def _deregister(client: httpx.AsyncClient, base: str, instance_id: str) -> None:
    try:
        await client.delete(f"{base}/v1/instances/{instance_id}", timeout=2.0)
    except httpx.HTTPError:
        log.warning("deregistration failed; the scheduler will declare the instance dead")
