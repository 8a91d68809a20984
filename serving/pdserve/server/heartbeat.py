"""Registration with the pdserve scheduler, when --scheduler-url is set (the client lives in pdserve.scheduler)."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.common.tls import client_context
from pdserve.scheduler.client import read_token, run_heartbeats
from pdserve.server.settings import ServerSettings


def read_scheduler_token(settings: ServerSettings) -> str | None:
    """The scheduler's instance token, read before the model loads so that a missing file fails the start."""
    if settings.scheduler_token_file is None:
        return None
    return read_token(settings.scheduler_token_file, "scheduler_token_file")


def start_heartbeats(
    settings: ServerSettings, token: str | None, service: Any, exporter: Any
) -> asyncio.Task[None] | None:
    """Start heartbeats to the scheduler in the background; None when no scheduler is configured."""
    if settings.scheduler_url is None or token is None:
        return None
    info = {
        "instance_id": f"{settings.role.value}-{settings.engine_id[:24]}",
        "role": settings.role.value,
        "version": settings.version,
        "kv_fingerprint": service.engine.fingerprint,
        "url": f"{settings.scheme}://{settings.advertised_host}:{settings.port}",
        "model": settings.model_name,
        "kv_host": settings.advertised_host if exporter is not None else None,
        "kv_port": exporter.server.port if exporter is not None else None,
        "supported_params": [],  # pdserve's engine honours none of ENGINE_OPTIONAL_PARAMS
        "max_model_len": service.max_model_len,
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
        run_heartbeats(
            settings.scheduler_url,
            info,
            load,
            token=token,
            interval=settings.heartbeat_seconds,
            verify=client_context(settings),
        )
    )
