"""The node dashboard (node_exporter): CPU, memory, network, filesystems, clock sync and load of every node."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard

from pdstack.contract.components import NODE_JOB

from ..panels import RATE, Query, board, label_variable, panel


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
