"""The KV dashboard: the KV channel's bytes, goodput against the link, latency and failures by cause, its leases,
cold and warm pulls, and where decode got each request's KV."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from ..panels import DC, RATE, Query, board, label_variable, panel, quantiles, zero_if_none


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
                        zero_if_none(
                            f"sum by (datacenter, exported_role, cause) "
                            f"(rate(pdserve_kv_transfer_failures_total{{{DC}}}[{RATE}]))"
                        ),
                        "{{datacenter}} {{exported_role}} {{cause}}",
                    ),
                    Query(
                        zero_if_none(
                            f"sum by (datacenter, cause, action) (rate(pdserve_kv_load_failures_total{{{DC}}}[{RATE}]))"
                        ),
                        "decode {{datacenter}} {{cause}} -> {{action}}",
                    ),
                    Query(
                        zero_if_none(f"sum by (datacenter) (rate(pdserve_kv_auth_refused_total{{{DC}}}[{RATE}]))"),
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
