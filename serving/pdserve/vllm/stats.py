"""KV channel metrics through vLLM's connector-stats path, into the vLLM API server's own `/metrics`.

Metrics registered in vLLM's worker process are never scraped. So the worker records what pdserve.kv observes
(on a private registry) and hands each step's news to vLLM as a KVConnectorStats; vLLM carries it to the API
server process, where PdstackPromMetrics records it under pdserve's names (pdserve_kv_transfer_bytes,
pdserve_kv_transfer_seconds, pdserve_kv_transfer_goodput_bytes_per_second, pdserve_kv_transfer_failures,
pdserve_kv_connections,
pdserve_kv_auth_refused, pdserve_kv_connections_dropped, pdserve_kv_connect_retries, pdserve_kv_leases_released,
pdserve_kv_lease_bytes, pdserve_kv_leases) with vLLM's
engine labels. vLLM forwards stats at engine steps only: an idle prefill's numbers advance at its next step.

Like a pdserve server, a decode engine counts the requests whose remote KV it could not use as
pdserve_kv_load_failures{cause, action} (action: its kv_load_failure_policy), and an engine deployed by pdstack
(kv_connector_extra_config.release_version) exports pdserve_build_info{version, role}: the canary judge joins the
two on the scrape's instance to attribute KV failures to a release (pdstack/canary/prom.py).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, get_args

from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from pdserve.kv.errors import Cause
from pdserve.kv.metrics import GBPS_BUCKETS, SECONDS_BUCKETS, KVMetrics
from pdserve.vllm.settings import release_version


def _empty() -> dict[str, Any]:
    return {
        "transfers": [],
        "failures": [],
        "load_failures": [],
        "connections": [],
        "auth_refused": 0,
        "released": {},
        "dropped": {},
        "connect_retries": {},
        "gauges": {},
    }


COUNTED_BY_LABEL = ("released", "dropped", "connect_retries")  # news kept as {label value: count}


def _add_count(counts: dict[str, int], label: str, count: int = 1) -> None:
    counts[label] = counts.get(label, 0) + count


class RecordingKVMetrics(KVMetrics):
    """pdserve.kv's metrics on a private registry, remembering each event (through KVMetrics' observe_* hooks)
    until taken."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self._lock = threading.Lock()
        self._news = _empty()

    def observe_transfer(self, role: str, nbytes: int, seconds: float) -> None:
        super().observe_transfer(role, nbytes, seconds)
        with self._lock:
            self._news["transfers"].append([role, nbytes, seconds])

    def observe_failure(self, role: str, cause: str) -> None:
        super().observe_failure(role, cause)
        with self._lock:
            self._news["failures"].append([role, cause])

    def observe_load_failure(self, cause: str) -> None:
        """A request's remote KV could not be loaded (left to vLLM's kv_load_failure_policy)."""
        with self._lock:
            self._news["load_failures"].append(cause)

    def observe_connection(self, role: str, outcome: str) -> None:
        super().observe_connection(role, outcome)
        with self._lock:
            self._news["connections"].append([role, outcome])

    def observe_auth_refused(self) -> None:
        super().observe_auth_refused()
        with self._lock:
            self._news["auth_refused"] += 1

    def observe_dropped(self, reason: str) -> None:
        super().observe_dropped(reason)
        with self._lock:
            _add_count(self._news["dropped"], reason)

    def observe_connect_retry(self, cause: str) -> None:
        super().observe_connect_retry(cause)
        with self._lock:
            _add_count(self._news["connect_retries"], cause)

    def observe_lease_released(self, reason: str) -> None:
        super().observe_lease_released(reason)
        with self._lock:
            _add_count(self._news["released"], reason)

    def observe_leases(self, nbytes: int, count: int) -> None:
        super().observe_leases(nbytes, count)
        with self._lock:
            self._news["gauges"].update({"lease_bytes": nbytes, "leases": count})

    def take(self) -> dict[str, Any]:
        """What happened since the last call (counter increments, the gauges' latest values), as plain data."""
        with self._lock:
            news, self._news = self._news, _empty()
        return news


@dataclass
class PdstackStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        self.data["transfers"] = [*self.data["transfers"], *theirs.get("transfers", [])]
        self.data["failures"] = [*self.data["failures"], *theirs.get("failures", [])]
        self.data["load_failures"] = [*self.data["load_failures"], *theirs.get("load_failures", [])]
        self.data["connections"] = [*self.data["connections"], *theirs.get("connections", [])]
        self.data["auth_refused"] += theirs.get("auth_refused", 0)
        for news in COUNTED_BY_LABEL:
            for label, count in theirs.get(news, {}).items():
                _add_count(self.data.setdefault(news, {}), label, count)
        self.data["gauges"].update(theirs.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        transfers = self.data["transfers"]
        seconds = sum(item[2] for item in transfers)
        nbytes = sum(item[1] for item in transfers)
        return {
            "transfers": len(transfers),
            "bytes": nbytes,
            "goodput_gbit_s": round(nbytes * 8 / seconds / 1e9, 3) if seconds > 0 else 0.0,
            "failures": len(self.data["failures"]),
            "auth_refused": self.data["auth_refused"],
        }

    def is_empty(self) -> bool:
        data = self.data
        return not (
            data["transfers"]
            or data["failures"]
            or data["load_failures"]
            or data["connections"]
            or data["auth_refused"]
            or data["gauges"]
            or any(data.get(news) for news in COUNTED_BY_LABEL)
        )


class PdstackPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        by_role = [*labelnames, "role"]
        self.bytes = self._counter_cls(
            name="pdserve_kv_transfer_bytes",
            documentation="KV payload bytes moved over the KV channel",
            labelnames=by_role,
        )
        self.seconds = self._histogram_cls(
            name="pdserve_kv_transfer_seconds",
            documentation="Duration of whole KV transfers",
            buckets=SECONDS_BUCKETS,
            labelnames=by_role,
        )
        self.goodput = self._histogram_cls(
            name="pdserve_kv_transfer_goodput_bytes_per_second",
            documentation="Goodput of whole KV transfers (bytes/s)",
            buckets=GBPS_BUCKETS,
            labelnames=by_role,
        )
        self.failures = self._counter_cls(
            name="pdserve_kv_transfer_failures",
            documentation="Failed KV transfers by cause",
            labelnames=[*by_role, "cause"],
        )
        self.load_failures = self._counter_cls(
            name="pdserve_kv_load_failures",
            documentation="Requests whose remote KV could not be used, by cause and the action taken",
            labelnames=[*labelnames, "cause", "action"],
        )
        self.action = str(vllm_config.kv_transfer_config.kv_load_failure_policy)
        if vllm_config.kv_transfer_config.kv_role == "kv_consumer":  # from 0: increase() counts a first failure
            for engine, cause in itertools.product(per_engine_labelvalues.values(), get_args(Cause)):
                self.load_failures.labels(*engine, cause, self.action)
        self._build_info(vllm_config)
        self.connections = self._counter_cls(
            name="pdserve_kv_connections",
            documentation="Connections KV requests ran on, by outcome (new, reused, stale)",
            labelnames=[*by_role, "outcome"],
        )
        auth_refused = self._counter_cls(
            name="pdserve_kv_auth_refused",
            documentation="Connections refused for missing or wrong authentication",
            labelnames=labelnames,
        )
        self.auth_refused = create_metric_per_engine(auth_refused, per_engine_labelvalues)
        self.released = self._counter_cls(
            name="pdserve_kv_leases_released",
            documentation="KV leases released, by reason (ack, expired, aborted, replaced)",
            labelnames=[*labelnames, "reason"],
        )
        self.dropped = self._counter_cls(
            name="pdserve_kv_connections_dropped",
            documentation="Connections the KV listener closed before they authenticated, by reason (evicted, "
            "deadline, handshake, tls, capacity)",
            labelnames=[*labelnames, "reason"],
        )
        self.connect_retries = self._counter_cls(
            name="pdserve_kv_connect_retries",
            documentation="Connects to a KV server made again, by the cause of the failed one",
            labelnames=[*labelnames, "cause"],
        )
        lease_bytes = self._gauge_cls(
            name="pdserve_kv_lease_bytes",
            documentation="KV bytes held under lease",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        leases = self._gauge_cls(
            name="pdserve_kv_leases",
            documentation="KV blobs held under lease",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.gauges = {
            "lease_bytes": create_metric_per_engine(lease_bytes, per_engine_labelvalues),
            "leases": create_metric_per_engine(leases, per_engine_labelvalues),
        }

    def _build_info(self, vllm_config: Any) -> None:
        """pdserve_build_info{version, role} = 1 once per API server, without engine labels: the judge's join
        needs one series per scraped instance."""
        transfer = vllm_config.kv_transfer_config
        version = release_version(transfer.kv_connector_extra_config or {})
        if version is None:
            return
        build = self._gauge_cls(
            name="pdserve_build_info",
            documentation="Release and role of this server (always 1; join on instance)",
            labelnames=["version", "role"],
            multiprocess_mode="mostrecent",
        )
        build.labels(version, "prefill" if transfer.kv_role == "kv_producer" else "decode").set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for role, nbytes, seconds in transfer_stats_data.get("transfers", []):
            self.bytes.labels(*engine, role).inc(nbytes)
            self.seconds.labels(*engine, role).observe(seconds)
            self.goodput.labels(*engine, role).observe(nbytes / seconds if seconds > 0 else 0.0)
        for role, cause in transfer_stats_data.get("failures", []):
            self.failures.labels(*engine, role, cause).inc()
        for cause in transfer_stats_data.get("load_failures", []):
            self.load_failures.labels(*engine, cause, self.action).inc()
        for role, outcome in transfer_stats_data.get("connections", []):
            self.connections.labels(*engine, role, outcome).inc()
        if transfer_stats_data.get("auth_refused"):
            self.auth_refused[engine_idx].inc(transfer_stats_data["auth_refused"])
        for news, counter in (
            ("released", self.released),
            ("dropped", self.dropped),
            ("connect_retries", self.connect_retries),
        ):
            for label, count in transfer_stats_data.get(news, {}).items():
                counter.labels(*engine, label).inc(count)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self.gauges:
                self.gauges[name][engine_idx].set(value)
