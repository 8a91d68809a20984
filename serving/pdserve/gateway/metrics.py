"""Prometheus metrics of the gateway, on a registry of its own."""

from __future__ import annotations

import re

from prometheus_client import Counter, Gauge, Histogram

from pdserve.common.registry import component_registry
from pdserve.scheduler.protocol import ENGINE_OPTIONAL_PARAMS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BYTES_BUCKETS = tuple(float(4**k) * 1024 for k in range(1, 12))
REFUSED_FIELDS = frozenset(
    {
        "authorization",
        "body",
        "model",
        "prompt",
        "messages",
        "kv_transfer_params",
        "temperature",
        "top_p",
        "top_k",
        "presence_penalty",
        "frequency_penalty",
        "n",
        "seed",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "echo",
        "suffix",
        "return_token_ids",
        *ENGINE_OPTIONAL_PARAMS,
    }
)
"""The values of pdserve_gateway_invalid_requests' `field` label: a field named by a client's JSON key counts as
`other`, so that no client can grow /metrics by sending new names."""


def field_label(field: str) -> str:
    """The request field a refusal names (`messages[2].role` -> `messages`), as a label from REFUSED_FIELDS."""
    root = re.split(r"[.\[]", field, maxsplit=1)[0]
    return root if root in REFUSED_FIELDS else "other"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = component_registry()
        r = self.registry
        self.requests = Counter(
            "pdserve_gateway_requests",
            "Requests by endpoint, HTTP status, tenant and version",
            ["endpoint", "status", "tenant", "version"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_gateway_time_to_first_token_seconds",
            "Request arrival to first streamed token",
            ["version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_gateway_inter_token_latency_seconds",
            "Gap between streamed events",
            ["version"],
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_gateway_request_duration_seconds",
            "Request arrival to last byte",
            ["endpoint", "version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "pdserve_gateway_prefill_duration_seconds",
            "Duration of remote prefill calls",
            ["version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rate_limited = Counter(
            "pdserve_gateway_rate_limited", "Requests refused by a rate limit", ["tenant", "limit"], registry=r
        )
        self.auth_failures = Counter("pdserve_gateway_auth_failures", "Requests without a valid API key", registry=r)
        self.invalid = Counter(
            "pdserve_gateway_invalid_requests",
            "Requests refused by validation, by top-level field (a fixed set; `other` for any other name)",
            ["field"],
            registry=r,
        )
        self.routing = Counter(
            "pdserve_gateway_routing_decisions",
            "Instances chosen, by role, instance and reason",
            ["role", "instance", "version", "reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "pdserve_gateway_upstream_errors", "Failed upstream calls by role and cause", ["role", "cause"], registry=r
        )
        self.retries = Counter(
            "pdserve_gateway_retries", "Upstream calls retried on another instance", ["role"], registry=r
        )
        self.stream_errors = Counter(
            "pdserve_gateway_stream_errors",
            "Streams ended with an error event after the first token",
            ["cause"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "pdserve_gateway_client_disconnects", "Requests whose client went away before the end", registry=r
        )
        self.kv_bytes = Histogram(
            "pdserve_gateway_kv_transfer_bytes",
            "KV bytes moved per request, as decode reports",
            buckets=BYTES_BUCKETS,
            registry=r,
        )
        self.kv_seconds = Histogram(
            "pdserve_gateway_kv_transfer_seconds",
            "KV transfer time per request, as decode reports",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_source = Counter(
            "pdserve_gateway_kv_sources",
            "Where decode got each request KV: remote, recompute, local",
            ["source"],
            registry=r,
        )
        self.early_prefills = Counter(
            "pdserve_gateway_early_dispatch_prefills",
            "Prefills sent alongside their decode (early dispatch), by outcome: ok, "
            "finished_early, cancelled, or the upstream error's cause",
            ["outcome"],
            registry=r,
        )
        self.kv_releases = Counter(
            "pdserve_gateway_kv_releases",
            "KV leases the gateway asked prefill to free because no decode will pull them (decode refused the "
            "request, or the client left before decode started), by outcome: released, not_held, unsupported, failed",
            ["outcome"],
            registry=r,
        )
        self.inflight = Gauge("pdserve_gateway_inflight_requests", "Requests in progress", registry=r)
        self.rate_limit_shared = Gauge(
            "pdserve_gateway_rate_limit_shared",
            "1 while rate limits are kept in the store shared by the replicas; 0 while "
            "they are kept in this process (memory:// or the store failing)",
            registry=r,
        )
        self.table_generation = Gauge(
            "pdserve_gateway_routing_table_generation", "Generation of the routing table in use", registry=r
        )
        self.table_errors = Counter(
            "pdserve_gateway_routing_table_poll_errors", "Failed routing-table polls", registry=r
        )
