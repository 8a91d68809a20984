"""The fleet dashboard: requests, errors and latency through the gateways by release version, the canary's
weight, verdicts and share, instances by state, and the gateways' refusals."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from ..panels import RATE, REQUESTS, Query, board, panel, quantiles, zero_if_none


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
                        zero_if_none(
                            f"sum by (exported_role, cause) (rate(pdserve_gateway_upstream_errors_total[{RATE}]))"
                        ),
                        "upstream {{exported_role}} {{cause}}",
                    ),
                    Query(
                        zero_if_none(f"sum by (tenant, limit) (rate(pdserve_gateway_rate_limited_total[{RATE}]))"),
                        "rate limited {{tenant}} {{limit}}",
                    ),
                    Query(zero_if_none(f"sum(rate(pdserve_gateway_auth_failures_total[{RATE}]))"), "auth failures"),
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
