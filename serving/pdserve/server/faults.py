"""Fault-injection switches for canary tests: a "bad release" that fails, slows down or changes its outputs.

All three are off by default; the deploy tests turn them on through PDSERVE_FAULT_* variables on a canary node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

from pdserve.engine.sampling import SamplingParams
from pdserve.server.schemas import RequestError
from pdserve.server.settings import ServerSettings

PERTURBED_TEMPERATURE = 1.5  # far enough from greedy that a tiny model's tokens differ
PERTURBED_SEED = 7


async def before_request(settings: ServerSettings) -> None:
    """Delay the request, then fail it with an injected 500 at the configured rate."""
    if settings.fault_delay_ms > 0:
        await asyncio.sleep(settings.fault_delay_ms / 1000)
    if settings.fault_error_rate > 0 and random.random() < settings.fault_error_rate:  # noqa: S311 (not crypto)
        raise RequestError("injected fault (PDSERVE_FAULT_ERROR_RATE)", status=500, kind="injected_fault")


def sampling(settings: ServerSettings, params: SamplingParams) -> SamplingParams:
    """With fault_perturb_output, sample hot with a fixed seed: deterministic, but not the greedy output."""
    if not settings.fault_perturb_output:
        return params
    return dataclasses.replace(
        params,
        temperature=PERTURBED_TEMPERATURE,
        top_k=0,
        top_p=1.0,
        seed=params.seed if params.seed is not None else PERTURBED_SEED,
    )
