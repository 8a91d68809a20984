"""Prometheus metrics of the KV channel, registered on a registry the serving process exposes."""

from __future__ import annotations

from functools import lru_cache

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Goodput in bytes/s (Prometheus base units; Gbit/s = value * 8 / 1e9), buckets from 0.01 to 100 Gbit/s.
GBPS_BUCKETS = tuple(gbit * 1e9 / 8 for gbit in (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0))


class KVMetrics:
    """One set of KV-channel metrics; `role` is "sender" (prefill) or "receiver" (decode)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        self.bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV payload bytes moved over the KV channel", ["role"], registry=reg
        )
        self.seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Duration of whole KV transfers",
            ["role"],
            buckets=SECONDS_BUCKETS,
            registry=reg,
        )
        self.gbps = Histogram(
            "pdserve_kv_transfer_goodput_bytes_per_second",
            "Goodput of whole KV transfers (bytes/s)",
            ["role"],
            buckets=GBPS_BUCKETS,
            registry=reg,
        )
        self.last_gbps = Gauge(
            "pdserve_kv_transfer_last_goodput_bytes_per_second",
            "Goodput of the latest KV transfer (bytes/s)",
            ["role"],
            registry=reg,
        )
        self.failures = Counter(
            "pdserve_kv_transfer_failures", "Failed KV transfers by cause", ["role", "cause"], registry=reg
        )
        self.connections = Counter(
            "pdserve_kv_connections",
            "Connections KV requests (pull streams, acks) ran on, by outcome: new (opened for the request), reused "
            "(kept open from an earlier request), stale (receiver: a pooled connection the sender had closed, "
            "replaced by a new one)",
            ["role", "outcome"],
            registry=reg,
        )
        self.auth_refused = Counter(
            "pdserve_kv_auth_refused", "Connections refused for missing or wrong authentication", registry=reg
        )
        self.dropped = Counter(
            "pdserve_kv_connections_dropped",
            "Connections the KV listener closed before they authenticated, by reason: evicted (a newer "
            "unauthenticated one took its slot), deadline (handshake, TLS included, too slow), handshake (bad HELLO "
            "or AUTH: wrong key, bad frame), tls (TLS handshake failed), capacity (authenticated connections at cap)",
            ["reason"],
            registry=reg,
        )
        self.connect_retries = Counter(
            "pdserve_kv_connect_retries",
            "Connects to a KV server made again, by the cause of the failed one (connection, timeout, capacity)",
            ["cause"],
            registry=reg,
        )
        self.lease_bytes = Gauge("pdserve_kv_lease_bytes", "KV bytes held under lease", registry=reg)
        self.leases = Gauge("pdserve_kv_leases", "KV blobs held under lease", registry=reg)
        self.lease_released = Counter(
            "pdserve_kv_leases_released",
            "KV leases released, by reason (ack, expired, aborted: never completed, replaced: prefilled again)",
            ["reason"],
            registry=reg,
        )

    def observe_transfer(self, role: str, nbytes: int, seconds: float) -> None:
        self.bytes.labels(role).inc(nbytes)
        self.seconds.labels(role).observe(seconds)
        goodput = nbytes / seconds if seconds > 0 else 0.0
        self.gbps.labels(role).observe(goodput)
        self.last_gbps.labels(role).set(goodput)

    def observe_failure(self, role: str, cause: str) -> None:
        self.failures.labels(role, cause).inc()

    # The KV channel records everything through these observe_* methods (never by touching a metric itself), so a
    # subclass can see each event too: vLLM's connector forwards them to the API server that is scraped.

    def observe_connection(self, role: str, outcome: str) -> None:
        self.connections.labels(role, outcome).inc()

    def observe_auth_refused(self) -> None:
        self.auth_refused.inc()

    def observe_dropped(self, reason: str) -> None:
        self.dropped.labels(reason).inc()

    def observe_connect_retry(self, cause: str) -> None:
        self.connect_retries.labels(cause).inc()

    def observe_lease_released(self, reason: str) -> None:
        self.lease_released.labels(reason).inc()

    def observe_leases(self, nbytes: int, count: int) -> None:
        self.lease_bytes.set(nbytes)
        self.leases.set(count)


@lru_cache(maxsize=1)
def default_metrics() -> KVMetrics:
    """The process-wide metrics on prometheus_client's default registry."""
    return KVMetrics(REGISTRY)
