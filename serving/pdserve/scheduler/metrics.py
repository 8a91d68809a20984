"""Prometheus metrics of the scheduler: counters updated as things happen, gauges read from the registry at scrape."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.common.registry import component_registry

from .advisor import Advice
from .registry import Registry

STATES = ("starting", "ready", "draining", "dead")


class SchedulerMetrics:
    def __init__(
        self, registry: Registry, weights: Callable[[], dict[str, float]], advice: Callable[[], Advice]
    ) -> None:
        self.prometheus = component_registry()
        self.transitions = Counter(
            "pdserve_scheduler_instance_transitions",
            "Instance state transitions, by new state",
            ["state"],
            registry=self.prometheus,
        )
        self.heartbeats = Counter(
            "pdserve_scheduler_heartbeats",
            "Heartbeats received, by result (ok or unknown)",
            ["result"],
            registry=self.prometheus,
        )
        self.table_polls = Counter(
            "pdserve_scheduler_routing_table_polls",
            "Routing table requests, by result (changed or not_modified)",
            ["result"],
            registry=self.prometheus,
        )
        self.admin_requests = Counter(
            "pdserve_scheduler_admin_requests",
            "Weight updates, by result (ok, invalid); refusals are in pdserve_scheduler_requests_unauthorized",
            ["result"],
            registry=self.prometheus,
        )
        self.canary_verdicts = Counter(
            "pdserve_scheduler_canary_verdicts",
            "Canary judge verdicts the deploy recorded, by canary and baseline version and outcome (pass, fail, "
            "inconclusive)",
            ["canary", "baseline", "outcome"],
            registry=self.prometheus,
        )
        self.canary_step = Gauge(
            "pdserve_scheduler_canary_step_percent",
            "The canary's share of traffic at its latest judged step, by canary version",
            ["canary"],
            registry=self.prometheus,
        )
        self.unauthorized = Counter(
            "pdserve_scheduler_requests_unauthorized",
            "Requests refused before running, by endpoint and reason (missing_token, invalid_token: 401; "
            "forbidden: 403, a valid token of a principal the endpoint does not serve)",
            ["endpoint", "reason"],
            registry=self.prometheus,
        )
        self.joins = Counter(
            "pdserve_scheduler_joins",
            "Nodes' joins (POST /v1/join), by result: ok, or the fixed reason of a refusal (busy, body, method, url, "
            "action, headers, audience, engine_id, sts_refused, sts_unavailable, identity, role, session)",
            ["result"],
            registry=self.prometheus,
        )
        self.prometheus.register(_StateCollector(registry, weights, advice))


class _StateCollector(Collector):
    def __init__(
        self, registry: Registry, weights: Callable[[], dict[str, float]], advice: Callable[[], Advice]
    ) -> None:
        self._registry = registry
        self._weights = weights
        self._advice = advice

    def collect(self) -> Iterator[GaugeMetricFamily]:
        instances = GaugeMetricFamily(
            "pdserve_scheduler_instances",
            "Registered instances by role, state and version",
            labels=["role", "state", "version"],
        )
        tally = Tally((i.info.role, i.state, i.info.version) for i in self._registry.all())
        for (role, state, version), count in sorted(tally.items()):
            instances.add_metric([role, state, version], count)
        yield instances

        weights = GaugeMetricFamily(
            "pdserve_scheduler_version_weight", "Traffic weight per version", labels=["version"]
        )
        for version, weight in sorted(self._weights().items()):
            weights.add_metric([version], weight)
        yield weights

        advice = self._advice()
        utilisation = GaugeMetricFamily(
            "pdserve_scheduler_utilisation_ratio",
            "Mean utilisation of ready instances (busier of slots and KV memory)",
            labels=["role"],
        )
        recommended = GaugeMetricFamily(
            "pdserve_scheduler_recommended_instances",
            "Instances recommended at the target utilisation",
            labels=["role"],
        )
        direction = GaugeMetricFamily(
            "pdserve_scheduler_scale_direction", "Recommended scaling: 1 up, 0 hold, -1 down", labels=["role"]
        )
        for role, role_advice in (("prefill", advice.prefill), ("decode", advice.decode)):
            utilisation.add_metric([role], role_advice.utilisation)
            recommended.add_metric([role], role_advice.recommended_instances)
            direction.add_metric([role], {"up": 1, "hold": 0, "down": -1}[role_advice.scale])
        yield utilisation
        yield recommended
        yield direction
        yield GaugeMetricFamily(
            "pdserve_scheduler_recommended_pd_ratio",
            "Recommended prefill instances per decode instance",
            value=advice.recommended_pd_ratio,
        )
        yield GaugeMetricFamily(
            "pdserve_scheduler_routing_table_generation",
            "Generation of the routing table",
            value=self._registry.generation,
        )
