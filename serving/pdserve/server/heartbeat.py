"""Registration with the pdserve scheduler, when --scheduler-url is set (the client lives in pdserve.scheduler)."""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from pdserve.server.settings import ServerSettings

log = logging.getLogger(__name__)


def start_heartbeats(settings: ServerSettings, service: Any, exporter: Any) -> asyncio.Task[None] | None:
    """Start heartbeats to the scheduler in the background; None when no scheduler is configured."""
    if settings.scheduler_url is None:
        return None
    try:
        client = importlib.import_module("pdserve.scheduler.client")
    except ImportError:
        log.error("scheduler_url is set but pdserve.scheduler.client is not installed; not registering")
        return None
    info = {
        "instance_id": f"{settings.role.value}-{settings.engine_id[:24]}",
        "role": settings.role.value,
        "version": settings.version,
        "kv_fingerprint": service.engine.fingerprint,
        "url": f"http://{settings.advertised_host}:{settings.port}",
        "model": settings.model_name,
        "kv_host": settings.advertised_host if exporter is not None else None,
        "kv_port": exporter.server.port if exporter is not None else None,
    }

    def load() -> dict[str, Any]:
        return {
            "ready": True,
            "active_requests": service.scheduler.running,
            "queue_depth": max(service.admission.requests - service.scheduler.running, 0),
            "max_concurrency": service.admission.max_num_seqs,
            "kv_used_bytes": service.admission.reserved,
            "kv_capacity_bytes": service.admission.kv_memory_bytes,
            "outstanding_prompt_tokens": service.scheduler.outstanding_prompt_tokens,
        }

    return asyncio.get_running_loop().create_task(
        client.run_heartbeats(settings.scheduler_url, info, load, settings.heartbeat_seconds)
    )
