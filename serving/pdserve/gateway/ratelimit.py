"""Token buckets per tenant: one for requests per second, one for (prompt + completion) tokens per minute."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .auth import TenantLimits


@dataclass
class TokenBucket:
    rate: float
    """refill per second"""
    capacity: float
    level: float = -1.0
    stamp: float = 0.0

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0 if it is now); refills first."""
        if self.level < 0:
            self.level, self.stamp = self.capacity, now
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float) -> None:
        self.level -= amount


@dataclass
class Decision:
    allowed: bool
    limit: str = ""
    retry_after: int = 0


@dataclass
class RateLimiter:
    defaults: TenantLimits
    overrides: dict[str, TenantLimits]
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, tuple[TokenBucket, TokenBucket]] = field(default_factory=dict)

    def token_budget(self, tenant: str) -> int:
        return self._limit(tenant, "tokens_per_minute")  # type: ignore[return-value]

    def check(self, tenant: str, tokens: int) -> Decision:
        """Take one request and `tokens` tokens from the tenant's buckets, or neither and say how long to wait."""
        requests, token_bucket = self._buckets_for(tenant)
        now = self.clock()
        waits = {"requests": requests.wait_for(1, now), "tokens": token_bucket.wait_for(tokens, now)}
        limit, wait = max(waits.items(), key=lambda item: item[1])
        if wait > 0:
            return Decision(False, limit, max(1, math.ceil(wait)))
        requests.take(1)
        token_bucket.take(tokens)
        return Decision(True)

    def _limit(self, tenant: str, name: str) -> float | int:
        override = getattr(self.overrides.get(tenant, self.defaults), name)
        value: float | int = override if override is not None else getattr(self.defaults, name)
        return value

    def _buckets_for(self, tenant: str) -> tuple[TokenBucket, TokenBucket]:
        if tenant not in self._buckets:
            rps, burst = self._limit(tenant, "requests_per_second"), self._limit(tenant, "request_burst")
            tpm = self._limit(tenant, "tokens_per_minute")
            self._buckets[tenant] = (TokenBucket(rate=rps, capacity=burst), TokenBucket(rate=tpm / 60, capacity=tpm))
        return self._buckets[tenant]
