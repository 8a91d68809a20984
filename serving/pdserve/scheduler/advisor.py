"""Prefill and decode utilisation, a recommended P:D ratio and a scale direction per role."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel

from .protocol import Role
from .registry import Instance

Direction = Literal["up", "down", "hold"]


class RoleAdvice(BaseModel):
    instances: int
    utilisation: float
    recommended_instances: int
    scale: Direction


class Advice(BaseModel):
    prefill: RoleAdvice
    decode: RoleAdvice
    recommended_pd_ratio: float
    """Recommended prefill instances per decode instance."""


def role_advice(instances: list[Instance], target: float, up: float, down: float) -> RoleAdvice:
    count = len(instances)
    busy = sum(i.load.utilisation() for i in instances)
    utilisation = busy / count if count else 0.0
    recommended = max(1, math.ceil(busy / target - 1e-9))
    if count == 0 or utilisation > up:
        scale: Direction = "up"
    elif utilisation < down and count > 1:
        scale = "down"
    else:
        scale = "hold"
    return RoleAdvice(
        instances=count, utilisation=round(utilisation, 4), recommended_instances=recommended, scale=scale
    )


def advise(ready: list[Instance], target: float, up: float, down: float) -> Advice:
    def of_role(role: Role) -> list[Instance]:
        return [i for i in ready if i.info.role == role]

    prefill = role_advice(of_role("prefill"), target, up, down)
    decode = role_advice(of_role("decode"), target, up, down)
    return Advice(
        prefill=prefill,
        decode=decode,
        recommended_pd_ratio=round(prefill.recommended_instances / decode.recommended_instances, 4),
    )
