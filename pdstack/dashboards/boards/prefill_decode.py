"""The prefill/decode dashboard: each role's utilisation, the P:D ratio and instances recommended and running,
queues, KV cache usage, batches and tokens per engine step, and capacity refusals."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from ..panels import DC, RATE, Query, board, label_variable, panel, quantiles, zero_if_none


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
                        zero_if_none(
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
