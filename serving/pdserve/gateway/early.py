"""Early dispatch: prefill and decode at once, so decode pulls the KV while prefill computes it.

Only for a plan whose prefill and decode both registered `kv_streaming` (and equal KV fingerprints, which routing
already requires). The gateway names the transfer (T, 32 random hex characters) and tells both sides:

- prefill: the request with max_tokens 1 and kv_transfer_params {"do_remote_decode": true,
  "pdstack_transfer_id": T}; its connector serves the KV under T, layer by layer as it is computed;
- decode: the request with kv_transfer_params naming T on the prefill's registered KV endpoint, signed with the
  params key (pdserve.kv.params; the gateway holds only that key derived from the KV channel key, never the
  channel key itself, so it can direct decode's pulls but cannot read any KV).

The gateway does not wait for prefill's answer: decode's own KV load failure policy covers a prefill that fails or
whose one token ends the request. Prefill's outcome is counted in pdserve_gateway_early_dispatch_prefills.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.kv import params as signed_params

from .proxy import PATHS, Context, PDProxy, UpstreamError, finished_early, prefill_body
from .routing import Plan

log = logging.getLogger(__name__)
ROUTE = "early_dispatch"


class ParamsKeyError(ValueError):
    """The params key file is unreadable or malformed; the message names the setting."""


def read_params_key(path: Path) -> bytes:
    """The params key from its file: 64 hex characters (pdserve.kv.params.derive_params_key(kv key).hex())."""
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ParamsKeyError(f"kv_params_key_file {path}: {exc.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ParamsKeyError(f"kv_params_key_file {path}: must hold the 32-byte params key as 64 hex characters")
    return key


def streams_kv(plan: Plan) -> bool:
    """Whether this plan can be dispatched early: both ends stream KV, and the prefill named its KV endpoint."""
    prefill = plan.prefill
    return (
        prefill is not None
        and prefill.info.kv_streaming
        and plan.decode.info.kv_streaming
        and prefill.info.kv_host is not None
        and prefill.info.kv_port is not None
    )


class EarlyDispatch:
    def __init__(self, proxy: PDProxy, key: bytes) -> None:
        self.proxy, self.key = proxy, key
        self._running: set[asyncio.Task[None]] = set()

    def start(self, ctx: Context, plan: Plan) -> tuple[dict[str, Any], asyncio.Task[None]]:
        """Send prefill in the background; the signed kv_transfer_params for decode, and the prefill's task."""
        prefill = plan.prefill
        assert prefill is not None
        transfer_id = secrets.token_hex(16)
        ctx.route = ROUTE
        task = asyncio.create_task(self._prefill(ctx, plan, transfer_id))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        params = {
            "do_remote_prefill": True,
            "remote_request_id": transfer_id,
            "remote_engine_id": prefill.instance_id,
            "remote_host": prefill.info.kv_host,
            "remote_port": prefill.info.kv_port,
            "remote_block_ids": None,
            "kv_fingerprint": prefill.info.kv_fingerprint,
            "pdstack_streamed": True,
        }
        return signed_params.sign(self.key, params), task

    async def _prefill(self, ctx: Context, plan: Plan, transfer_id: str) -> None:
        prefill, proxy = plan.prefill, self.proxy
        assert prefill is not None
        body = prefill_body(ctx.request.body)
        body["kv_transfer_params"] = {**body["kv_transfer_params"], "pdstack_transfer_id": transfer_id}
        url = prefill.info.url + PATHS[ctx.request.endpoint]
        timeout = httpx.Timeout(proxy.settings.prefill_timeout, connect=proxy.settings.connect_timeout)
        proxy.metrics.routing.labels("prefill", prefill.instance_id, plan.version, ROUTE).inc()
        started = time.perf_counter()
        outcome = "ok"
        try:
            with proxy.router.dispatched(prefill, ctx.request.prompt_tokens):
                response = await proxy.post("prefill", url, body, ctx, timeout)
            proxy.metrics.prefill.labels(ctx.version).observe(time.perf_counter() - started)
            if finished_early(_json(response)):
                outcome = "finished_early"
        except UpstreamError as exc:
            outcome = exc.cause
            proxy.failed(prefill, exc)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            proxy.metrics.early_prefills.labels(outcome).inc()
            log.info(
                "early-dispatch prefill ended",
                extra={"fields": {"request_id": ctx.request_id, "prefill": prefill.instance_id, "outcome": outcome}},
            )


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
