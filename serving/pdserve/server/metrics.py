"""Prometheus metrics of a serving process, on the registry /metrics exposes (the KV channel's metrics share it)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.kv import KVMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.kv = KVMetrics(registry)
        self.requests = Counter(
            "pdserve_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.rejected = Counter(
            "pdserve_requests_rejected", "Requests refused for capacity, by reason", ["reason"], registry=registry
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "pdserve_request_duration_seconds",
            "Time from request arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens admitted", registry=registry)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=registry)
        self.running = Gauge("pdserve_running_requests", "Requests in the running batch", registry=registry)
        self.admitted = Gauge(
            "pdserve_admitted_requests", "Requests admitted (pulling KV, prefilling or decoding)", registry=registry
        )
        self.kv_reserved = Gauge(
            "pdserve_kv_memory_reserved_bytes", "KV memory reserved by admitted requests", registry=registry
        )
        self.kv_limit = Gauge("pdserve_kv_memory_limit_bytes", "KV memory available to requests", registry=registry)
        self.step_batch = Histogram(
            "pdserve_step_batch_size", "Sequences in one engine step", buckets=BATCH_BUCKETS, registry=registry
        )
        self.step_tokens = Histogram(
            "pdserve_step_tokens", "Tokens fed to the engine in one step", buckets=TOKEN_BUCKETS, registry=registry
        )
        self.step_seconds = Histogram(
            "pdserve_step_duration_seconds", "Duration of one engine step", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.kv_unused = Counter(
            "pdserve_kv_leases_unused",
            "Release requests for KV no decode will pull (decode refused it, or the client left first), by "
            "outcome: released, or not_held (already acknowledged or expired)",
            ["outcome"],
            registry=registry,
        )
        self.kv_load_failures = Counter(
            "pdserve_kv_load_failures",
            "Remote KV that could not be used, by cause and the action taken",
            ["cause", "action"],
            registry=registry,
        )
        # The two gauges an endpoint picker (Gateway API Inference Extension) or a KV-aware router reads, with the
        # meaning vLLM gives vllm:num_requests_waiting and vllm:kv_cache_usage_perc (docs/observability.md). Their
        # values are read from the admission and the batch at scrape time (bind_router_gauges), so no code path can
        # leave them behind; 0 until the model is loaded.
        self.waiting = Gauge(
            "pdserve_num_requests_waiting",
            "Requests admitted but not yet in an engine step (pulling remote KV, or waiting for their first prompt "
            "chunk); as vllm:num_requests_waiting",
            registry=registry,
        )
        self.kv_usage = Gauge(
            "pdserve_kv_cache_usage_ratio",
            "KV memory reserved by admitted requests over the KV memory available (1 = full: the next request "
            "is refused); as vllm:kv_cache_usage_perc",
            registry=registry,
        )
        self.ready = Gauge(
            "pdserve_ready", "1 once the model is loaded and the server takes requests", registry=registry
        )
        self.build = Gauge(
            "pdserve_build_info",
            "Release and role of this server (always 1; join on instance)",
            ["version", "role"],
            registry=registry,
        )

    def bind_router_gauges(self, waiting: Callable[[], float], kv_usage: Callable[[], float]) -> None:
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)
