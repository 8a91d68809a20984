"""The Prometheus registry of a pdserve component: its own series plus its process's (prometheus_client's process_*)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, ProcessCollector


def component_registry() -> CollectorRegistry:
    """A registry that already holds process_start_time_seconds and the other process series: a restarted component
    shows a new start time at its next scrape, however briefly it was down between two (monitoring/alerts.yml's
    PdstackContainerRestarting)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry
