"""pdstack's dashboards: fleet, P/D, KV and node. Every query uses only metric names the components register.

Label names are those Prometheus stores: its scrape configs (roles/prometheus, infra/prometheus.py) set `role`
(the inventory group or pool role: control, prefill, decode), `datacenter` and `pool` on every pdserve target, so
a label the process itself calls `role` (the KV channel's sender/receiver, the scheduler's and the gateway's
prefill/decode) is stored as `exported_role`. Panels that show one engine's metric beside the other's (pdserve_*
and vllm:*) show whichever engine runs; the other query returns nothing.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from pdstack.contract import NODE_JOB

from .panels import DC, RATE, Query, board, label_variable, panel, quantiles

REQUESTS = "pdserve_gateway_requests_total"


def _zero_if_none(expr: str) -> str:
    """Counters of rare events have no series until the first event: show 0, not "No data" (on (): only while the
    query returns nothing, not as an extra series beside its own)."""
    return f"({expr}) or on () vector(0)"


def fleet() -> dashboard.Dashboard:
    by_version = f"sum by (version) (rate({REQUESTS}[{RATE}]))"
    errors = f'sum by (version) (rate({REQUESTS}{{status=~"5.."}}[{RATE}]))'
    return (
        board(
            "pdstack-fleet",
            "pdstack / fleet",
            "Requests, errors and latency through the gateways, by release version; the canary's traffic share.",
        )
        .with_panel(
            panel(
                "Requests by version",
                "reqps",
                [Query(by_version, "{{version}}")],
                "Requests answered by the gateways, per second.",
            )
        )
        .with_panel(
            panel(
                "Error ratio (5xx) by version",
                "percentunit",
                [Query(f"({errors} or {by_version} * 0) / {by_version}", "{{version}}")],
                "Share of gateway answers that were 5xx: the canary judge's success ratio, inverted.",
            )
        )
        .with_panel(
            panel(
                "Time to first token by version",
                "s",
                quantiles("pdserve_gateway_time_to_first_token_seconds", "version", legend="{{version}}"),
                "Request arrival to first streamed token, at the gateway.",
            )
        )
        .with_panel(
            panel(
                "Time per output token by version",
                "s",
                quantiles("pdserve_gateway_inter_token_latency_seconds", "version", legend="{{version}}"),
                "Gap between streamed events (TPOT), at the gateway.",
            )
        )
        .with_panel(
            panel(
                "End-to-end latency by version",
                "s",
                quantiles("pdserve_gateway_request_duration_seconds", "version", legend="{{version}}"),
                "Request arrival to last byte, at the gateway.",
            )
        )
        .with_panel(
            panel(
                "Canary: configured weight and traffic share",
                "percentunit",
                [
                    Query("pdserve_scheduler_version_weight", "weight {{version}}"),
                    Query(f"{by_version} / scalar(sum(rate({REQUESTS}[{RATE}])))", "share {{version}}"),
                ],
                "The scheduler's traffic weight per version beside the share of requests each version really served. "
                "The canary verdicts (pdstack canary judge) compare exactly these versions' error ratio and p95 "
                "latencies above.",
            )
        )
        .with_panel(
            panel(
                "Canary verdicts and step",
                "short",
                [
                    Query(
                        "sum by (canary, outcome) (increase(pdserve_scheduler_canary_verdicts_total[$__range]))",
                        "{{canary}} {{outcome}}",
                    ),
                    Query("pdserve_scheduler_canary_step_percent", "{{canary}} step %"),
                ],
                "Verdicts of pdstack canary judge at each step of a deploy (pass, fail, inconclusive), as the deploy "
                "recorded them with the scheduler, and the share of traffic the canary had at its latest judged step.",
                width=24,
            )
        )
        .with_panel(
            panel(
                "Instances by version and state",
                "short",
                [Query("sum by (version, state) (pdserve_scheduler_instances)", "{{version}} {{state}}")],
                "Instances the scheduler has registered.",
            )
        )
        .with_panel(
            panel(
                "Gateway errors and refusals",
                "reqps",
                [
                    Query(
                        _zero_if_none(
                            f"sum by (exported_role, cause) (rate(pdserve_gateway_upstream_errors_total[{RATE}]))"
                        ),
                        "upstream {{exported_role}} {{cause}}",
                    ),
                    Query(
                        _zero_if_none(f"sum by (tenant, limit) (rate(pdserve_gateway_rate_limited_total[{RATE}]))"),
                        "rate limited {{tenant}} {{limit}}",
                    ),
                    Query(_zero_if_none(f"sum(rate(pdserve_gateway_auth_failures_total[{RATE}]))"), "auth failures"),
                ],
                "Failed upstream calls by role and cause, rate-limit and authentication refusals.",
            )
        )
        .with_panel(
            panel(
                "In flight at the gateways",
                "short",
                [Query("sum(pdserve_gateway_inflight_requests)", "in flight")],
                "Requests in progress.",
                width=24,
            )
        )
    )


def prefill_decode() -> dashboard.Dashboard:
    server = f'{DC}, role=~"prefill|decode"'
    return (
        board(
            "pdstack-pd",
            "pdstack / prefill and decode",
            "Utilisation, queues and batches of the prefill and "
            "decode instances per datacenter; the scheduler's P:D recommendation.",
        )
        .with_variable(label_variable("datacenter", "Datacenter", "pdserve_build_info"))
        .with_panel(
            panel(
                "Utilisation by role",
                "percentunit",
                [Query("pdserve_scheduler_utilisation_ratio", "{{exported_role}}")],
                "Mean utilisation of ready instances (the busier of slots and KV memory), as the scheduler computes "
                "it for its scaling advice.",
            )
        )
        .with_panel(
            panel(
                "P:D ratio: recommended and running",
                "short",
                [
                    Query("pdserve_scheduler_recommended_pd_ratio", "recommended"),
                    Query(
                        'sum(pdserve_scheduler_instances{exported_role="prefill", state="ready"}) / '
                        'sum(pdserve_scheduler_instances{exported_role="decode", state="ready"})',
                        "running",
                    ),
                ],
                "Prefill instances per decode instance.",
            )
        )
        .with_panel(
            panel(
                "Instances: recommended and ready",
                "short",
                [
                    Query("pdserve_scheduler_recommended_instances", "recommended {{exported_role}}"),
                    Query(
                        'sum by (exported_role) (pdserve_scheduler_instances{state="ready"})', "ready {{exported_role}}"
                    ),
                    Query("pdserve_scheduler_scale_direction", "scale {{exported_role}} (1 up, -1 down)"),
                ],
                "The scheduler's scaling advice beside what runs.",
            )
        )
        .with_panel(
            panel(
                "Queue depth (requests waiting)",
                "short",
                [
                    Query(f"pdserve_num_requests_waiting{{{server}}}", "{{datacenter}} {{role}} {{instance}}"),
                    Query(f"vllm:num_requests_waiting{{{server}}}", "{{datacenter}} {{role}} {{instance}} (vLLM)"),
                ],
                "What an endpoint picker reads: requests admitted but not yet in an engine step.",
            )
        )
        .with_panel(
            panel(
                "KV cache usage",
                "percentunit",
                [
                    Query(f"pdserve_kv_cache_usage_ratio{{{server}}}", "{{datacenter}} {{role}} {{instance}}"),
                    Query(f"vllm:kv_cache_usage_perc{{{server}}}", "{{datacenter}} {{role}} {{instance}} (vLLM)"),
                ],
                "What an endpoint picker reads: 1 means full.",
            )
        )
        .with_panel(
            panel(
                "Running requests",
                "short",
                [
                    Query(f"pdserve_running_requests{{{server}}}", "{{datacenter}} {{role}} {{instance}}"),
                    Query(f"vllm:num_requests_running{{{server}}}", "{{datacenter}} {{role}} {{instance}} (vLLM)"),
                ],
                "Requests in the running batch.",
            )
        )
        .with_panel(
            panel(
                "Batch size per engine step",
                "short",
                [
                    *quantiles("pdserve_step_batch_size", "datacenter, role", server, "{{datacenter}} {{role}}"),
                ],
                "Sequences in one engine step (pdserve engine).",
            )
        )
        .with_panel(
            panel(
                "Tokens per engine step",
                "short",
                [
                    *quantiles("pdserve_step_tokens", "datacenter, role", server, "{{datacenter}} {{role}}")[:2],
                    *quantiles(
                        "vllm:iteration_tokens_total", "datacenter, role", server, "{{datacenter}} {{role}} (vLLM)"
                    )[:2],
                ],
                "Tokens fed to the engine in one step (prompt chunks and decodes).",
            )
        )
        .with_panel(
            panel(
                "Generated tokens per second",
                "short",
                [
                    Query(
                        f"sum by (datacenter, role) (rate(pdserve_generation_tokens_total{{{server}}}[{RATE}]))",
                        "{{datacenter}} {{role}}",
                    ),
                    Query(
                        f"sum by (datacenter, role) (rate(vllm:generation_tokens_total{{{server}}}[{RATE}]))",
                        "{{datacenter}} {{role}} (vLLM)",
                    ),
                ],
                "Token throughput per datacenter and role.",
            )
        )
        .with_panel(
            panel(
                "Requests refused for capacity",
                "reqps",
                [
                    Query(
                        _zero_if_none(
                            f"sum by (datacenter, role, reason) "
                            f"(rate(pdserve_requests_rejected_total{{{server}}}[{RATE}]))"
                        ),
                        "{{datacenter}} {{role}} {{reason}}",
                    ),
                ],
                "429 (concurrency) and 503 (KV memory) answers of the servers.",
            )
        )
    )


def kv() -> dashboard.Dashboard:
    receiver = f'{DC}, exported_role="receiver"'
    return (
        board(
            "pdstack-kv",
            "pdstack / KV transfer",
            "The KV channel between prefill and decode: bytes, goodput "
            "against the link's rate, latency, failures by cause, leases, cold and warm pulls.",
        )
        .with_variable(label_variable("datacenter", "Datacenter", "pdserve_build_info"))
        .with_variable(dashboard.TextBoxVariable("link_gbit").label("Link rate (Gbit/s)").default_value("1"))
        .with_panel(
            panel(
                "KV bytes per second",
                "Bps",
                [
                    Query(
                        f"sum by (datacenter, exported_role) (rate(pdserve_kv_transfer_bytes_total{{{DC}}}[{RATE}]))",
                        "{{datacenter}} {{exported_role}}",
                    ),
                ],
                "KV payload moved over the KV channel (sender: prefill, receiver: decode).",
            )
        )
        .with_panel(
            panel(
                "Goodput of KV transfers vs the link's rate",
                "Bps",
                [
                    *quantiles(
                        "pdserve_kv_transfer_goodput_bytes_per_second", "datacenter", receiver, "{{datacenter}}"
                    )[:2],
                    Query("vector($link_gbit * 125000000)", "link rate"),
                ],
                "Goodput of whole transfers as decode measured them, against the link rate set above.",
            )
        )
        .with_panel(
            panel(
                "KV transfer latency",
                "s",
                quantiles("pdserve_kv_transfer_seconds", "datacenter", receiver, "{{datacenter}}"),
                "Duration of whole KV transfers, at decode.",
            )
        )
        .with_panel(
            panel(
                "KV failures by cause",
                "ops",
                [
                    Query(
                        _zero_if_none(
                            f"sum by (datacenter, exported_role, cause) "
                            f"(rate(pdserve_kv_transfer_failures_total{{{DC}}}[{RATE}]))"
                        ),
                        "{{datacenter}} {{exported_role}} {{cause}}",
                    ),
                    Query(
                        _zero_if_none(
                            f"sum by (datacenter, cause, action) (rate(pdserve_kv_load_failures_total{{{DC}}}[{RATE}]))"
                        ),
                        "decode {{datacenter}} {{cause}} -> {{action}}",
                    ),
                    Query(
                        _zero_if_none(f"sum by (datacenter) (rate(pdserve_kv_auth_refused_total{{{DC}}}[{RATE}]))"),
                        "auth refused {{datacenter}}",
                    ),
                ],
                "Failed transfers by cause; what decode did about remote KV it could not use (recompute or fail).",
            )
        )
        .with_panel(
            panel(
                "Leases held",
                "bytes",
                [
                    Query(f"sum by (datacenter) (pdserve_kv_lease_bytes{{{DC}}})", "bytes {{datacenter}}"),
                ],
                "KV bytes prefill holds under lease until decode acknowledges them or the lease expires.",
            )
        )
        .with_panel(
            panel(
                "Leases: count and releases",
                "short",
                [
                    Query(f"sum by (datacenter) (pdserve_kv_leases{{{DC}}})", "held {{datacenter}}"),
                    Query(
                        f"sum by (reason) (rate(pdserve_kv_leases_released_total{{{DC}}}[{RATE}]))",
                        "released/s {{reason}}",
                    ),
                ],
                "Leases held and released by reason (ack, expired, aborted, replaced).",
            )
        )
        .with_panel(
            panel(
                "Cold and warm pulls",
                "ops",
                [
                    Query(
                        f"sum by (datacenter, outcome) (rate(pdserve_kv_connections_total{{{receiver}}}[{RATE}]))",
                        "{{datacenter}} {{outcome}}",
                    ),
                ],
                "Connections decode's pulls ran on: new (cold: a TCP and auth handshake first), reused (warm), stale "
                "(a pooled connection the sender had closed).",
            )
        )
        .with_panel(
            panel(
                "Where decode got the KV",
                "reqps",
                [
                    Query(f"sum by (source) (rate(pdserve_gateway_kv_sources_total[{RATE}]))", "{{source}}"),
                ],
                "remote (pulled), recompute (pull failed, recomputed), local (short prompt prefilled on decode).",
            )
        )
    )


def node() -> dashboard.Dashboard:
    job = f'job="{NODE_JOB}"'
    return (
        board(
            "pdstack-node",
            "pdstack / nodes",
            "node_exporter on every node: CPU, memory, network, disk and the "
            "clock state the KV leases and latency figures rely on.",
        )
        .with_variable(label_variable("instance", "Node", f"node_uname_info{{{job}}}"))
        .with_panel(
            panel(
                "CPU busy",
                "percentunit",
                [
                    Query(
                        f'1 - avg by (instance) (rate(node_cpu_seconds_total{{{job}, instance=~"$instance", '
                        f'mode="idle"}}[{RATE}]))',
                        "{{instance}}",
                    ),
                ],
                "Share of CPU time not idle.",
            )
        )
        .with_panel(
            panel(
                "Memory used",
                "percentunit",
                [
                    Query(
                        f'1 - node_memory_MemAvailable_bytes{{{job}, instance=~"$instance"}} / '
                        f'node_memory_MemTotal_bytes{{{job}, instance=~"$instance"}}',
                        "{{instance}}",
                    ),
                ],
                "Memory not available to new processes.",
            )
        )
        .with_panel(
            panel(
                "Network",
                "Bps",
                [
                    Query(
                        f'sum by (instance) (rate(node_network_receive_bytes_total{{{job}, instance=~"$instance", '
                        f'device!="lo"}}[{RATE}]))',
                        "in {{instance}}",
                    ),
                    Query(
                        f'sum by (instance) (rate(node_network_transmit_bytes_total{{{job}, instance=~"$instance", '
                        f'device!="lo"}}[{RATE}]))',
                        "out {{instance}}",
                    ),
                ],
                "Bytes received and sent on every device but loopback.",
            )
        )
        .with_panel(
            panel(
                "Filesystem free",
                "percentunit",
                [
                    Query(
                        f'min by (instance) (node_filesystem_avail_bytes{{{job}, instance=~"$instance"}} / '
                        f'node_filesystem_size_bytes{{{job}, instance=~"$instance"}})',
                        "{{instance}}",
                    ),
                ],
                "The fullest filesystem's free share (model weights, KV spill).",
            )
        )
        .with_panel(
            panel(
                "Clock offset and error",
                "s",
                [
                    Query(f'node_timex_offset_seconds{{{job}, instance=~"$instance"}}', "offset {{instance}}"),
                    Query(f'node_timex_maxerror_seconds{{{job}, instance=~"$instance"}}', "max error {{instance}}"),
                ],
                "The kernel's clock state (adjtimex), as chrony (time_sync role) steers it.",
            )
        )
        .with_panel(
            panel(
                "Clock synchronised",
                "short",
                [
                    Query(f'node_timex_sync_status{{{job}, instance=~"$instance"}}', "{{instance}}"),
                ],
                "1 while the kernel considers the clock synchronised.",
            )
        )
        .with_panel(
            panel(
                "Load",
                "short",
                [
                    Query(f'node_load1{{{job}, instance=~"$instance"}}', "{{instance}}"),
                ],
                "One-minute load average.",
                width=24,
            )
        )
    )


DASHBOARDS = {"fleet": fleet, "prefill-decode": prefill_decode, "kv": kv, "node": node}
"""File stem (monitoring/dashboards/<stem>.json) to the function building it."""
