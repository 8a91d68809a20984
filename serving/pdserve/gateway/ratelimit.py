"""Per-tenant rate limits, in a store every gateway replica shares (the `limits` library; Redis), or in this process.

Two limits per tenant: requests (the rate `requests_per_second` with bursts of `request_burst`: `request_burst`
requests per ceil(burst / rate) seconds, so the average never exceeds the rate) and (prompt + completion) tokens per
minute. Both are sliding-window counters, so a burst at a window's edge cannot double the limit. Unlike the token
bucket this replaces, a full burst is not topped up while its window lasts: 20 requests at once with a rate of 10/s
leave room for the 21st only as the 2 s window slides on. A request is refused (429 with Retry-After) when either
limit is spent, and then takes from neither.

A rediss:// store is reached over TLS with the gateway's client TLS settings (tls_ca, tls_client_cert; issue 17).
When the shared store fails, the gateway keeps limiting in this process (a warning, and gauge
pdserve_gateway_rate_limit_shared at 0) and probes the store every RETRY_SHARED_SECONDS in the background, so that it
shares again as soon as the store answers, whether requests come or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time
from dataclasses import dataclass
from typing import Any

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string
from prometheus_client import Gauge

from pdserve.common.tls import TLSClientSettings

from .auth import TenantLimits

log = logging.getLogger(__name__)
RETRY_SHARED_SECONDS = 5.0
STORE_TIMEOUT_SECONDS = 0.5
"""A store that does not answer within this is treated as down: a slow store must not slow every request."""
STORE_ERRORS = (StorageError, OSError, TimeoutError)


@dataclass
class Decision:
    allowed: bool
    limit: str = ""
    retry_after: int = 0


class RateLimiter:
    def __init__(
        self,
        defaults: TenantLimits,
        overrides: dict[str, TenantLimits],
        storage: str = "memory://",
        password: str | None = None,
        shared_gauge: Gauge | None = None,
        *,
        tls: TLSClientSettings | None = None,
    ) -> None:
        self.defaults, self.overrides = defaults, overrides
        self.shared_gauge = shared_gauge
        self.shared = not storage.startswith("memory://")
        self._local = SlidingWindowCounterRateLimiter(storage_from_string("async+memory://"))
        self._store = self._local
        if self.shared:
            self._store = SlidingWindowCounterRateLimiter(_shared_storage(storage, password, tls))
        self._use_store = self.shared
        self._prober: asyncio.Task[None] | None = None
        self._set_gauge()

    def token_budget(self, tenant: str) -> int:
        return int(self._limit(tenant, "tokens_per_minute"))

    def concurrency_cap(self, tenant: str) -> int:
        return int(self._limit(tenant, "max_concurrent_requests"))

    async def start(self) -> None:
        """Check the shared store once, so that a store down at start is reported at start, and start probing it."""
        if not self.shared:
            return
        if not await self._store_answers():
            self._fall_back("store did not answer at start")
        self._prober = asyncio.create_task(self._probe_while_down())

    async def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober

    async def check(self, tenant: str, tokens: int) -> Decision:
        """Take one request and `tokens` tokens from the tenant's limits, or neither and say how long to wait."""
        limiter = self._store if self._use_store else self._local
        try:
            return await _check(limiter, self._items(tenant), tenant, tokens)
        except STORE_ERRORS as exc:
            self._fall_back(type(exc).__name__)
            return await _check(self._local, self._items(tenant), tenant, tokens)

    async def spent(self, tenant: str) -> Decision:
        """Whether the tenant's limits leave room for any request at all (taking nothing): asked before its body is
        read, so that a tenant over its limit holds no memory with bodies it will be refused for anyway."""
        limiter = self._store if self._use_store else self._local
        try:
            return await _test(limiter, self._items(tenant), tenant)
        except STORE_ERRORS as exc:
            self._fall_back(type(exc).__name__)
            return await _test(self._local, self._items(tenant), tenant)

    async def _probe_while_down(self) -> None:
        while True:
            await asyncio.sleep(RETRY_SHARED_SECONDS)
            if not self._use_store and await self._store_answers():
                self._use_store = True
                self._set_gauge()
                log.warning("rate-limit store answers again: limits are shared by the replicas again")

    async def _store_answers(self) -> bool:
        try:
            return bool(await self._store.storage.check())
        except STORE_ERRORS:
            return False

    def _fall_back(self, cause: str) -> None:
        if self._use_store:
            log.warning(
                "rate-limit store failed: limiting in this process only (each replica gives the full limit) "
                "until it answers",
                extra={"fields": {"cause": cause}},
            )
        self._use_store = False
        self._set_gauge()

    def _set_gauge(self) -> None:
        if self.shared_gauge is not None:
            self.shared_gauge.set(1 if self._use_store else 0)

    def _limit(self, tenant: str, name: str) -> float:
        override = getattr(self.overrides.get(tenant, self.defaults), name)
        value: float = override if override is not None else getattr(self.defaults, name)
        return value

    def _items(self, tenant: str) -> tuple[RateLimitItem, RateLimitItem]:
        rate, burst = self._limit(tenant, "requests_per_second"), int(self._limit(tenant, "request_burst"))
        window = max(1, math.ceil(burst / rate))
        requests = RateLimitItemPerSecond(burst, window, namespace="pdserve-requests")
        tokens = RateLimitItemPerMinute(int(self._limit(tenant, "tokens_per_minute")), 1, namespace="pdserve-tokens")
        return requests, tokens


def _shared_storage(uri: str, password: str | None, tls: TLSClientSettings | None = None) -> Any:
    options: dict[str, Any] = {
        "implementation": "redispy",
        "wrap_exceptions": True,
        "socket_timeout": STORE_TIMEOUT_SECONDS,
        "socket_connect_timeout": STORE_TIMEOUT_SECONDS,
    }
    if password is not None:
        options["password"] = password
    if uri.startswith("rediss://"):
        options.update(store_ssl_options(tls))
    return storage_from_string("async+" + uri, **options)


def store_ssl_options(tls: TLSClientSettings | None) -> dict[str, Any]:
    """redis-py's TLS options for a rediss:// store: its certificate verified against tls_ca (unset: the system's
    CAs) and its host name checked; tls_client_cert presented when set (a store requiring client certificates)."""
    options: dict[str, Any] = {
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": True,
        "ssl_min_version": ssl.TLSVersion.TLSv1_2,
    }
    if tls is not None and tls.tls_ca is not None:
        options["ssl_ca_certs"] = str(tls.tls_ca)
    if tls is not None and tls.tls_client_cert is not None and tls.tls_client_key is not None:
        options["ssl_certfile"], options["ssl_keyfile"] = str(tls.tls_client_cert), str(tls.tls_client_key)
    return options


async def _check(
    limiter: SlidingWindowCounterRateLimiter, items: tuple[RateLimitItem, RateLimitItem], tenant: str, tokens: int
) -> Decision:
    requests, token_item = items
    for name, item, cost in (("requests", requests, 1), ("tokens", token_item, tokens)):
        if not await limiter.test(item, tenant, cost=cost):
            return await _refusal(limiter, name, item, tenant)
    if not await limiter.hit(requests, tenant):
        return await _refusal(limiter, "requests", requests, tenant)
    if not await limiter.hit(token_item, tenant, cost=tokens):  # another replica spent it since the test
        return await _refusal(limiter, "tokens", token_item, tenant)
    return Decision(True)


async def _test(
    limiter: SlidingWindowCounterRateLimiter, items: tuple[RateLimitItem, RateLimitItem], tenant: str
) -> Decision:
    for name, item in zip(("requests", "tokens"), items, strict=True):
        if not await limiter.test(item, tenant):
            return await _refusal(limiter, name, item, tenant)
    return Decision(True)


async def _refusal(limiter: SlidingWindowCounterRateLimiter, name: str, item: RateLimitItem, tenant: str) -> Decision:
    stats = await limiter.get_window_stats(item, tenant)
    return Decision(False, name, max(1, math.ceil(stats.reset_time - time.time())))
