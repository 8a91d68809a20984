"""The vllm: metrics the dashboards read are ones vLLM registers, with the sample names Prometheus stores.

The main suite checks every other name against the components' scrapes (tests/serving/gateway/
test_dashboard_queries.py); vLLM is importable only here. The names come from vLLM's own metric registrations
(the `name=` of each gauge, counter and histogram its loggers create), read from the installed package.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import vllm

from pdstack.dashboards.promql import metric_names, panels

DASHBOARDS = Path(__file__).resolve().parents[2] / "monitoring" / "dashboards"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


def registered_by_vllm() -> set[str]:
    """Sample names of every vllm: metric created in vLLM's metrics and KV-connector code."""
    root = Path(vllm.__file__).parent
    names: set[str] = set()
    for path in [*(root / "v1" / "metrics").rglob("*.py"), *(root / "distributed" / "kv_transfer").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            kind = next((k for k in SUFFIXES if k in func.lower()), None)
            for keyword in node.keywords:
                value = keyword.value
                if (
                    kind
                    and keyword.arg == "name"
                    and isinstance(value, ast.Constant)
                    and str(value.value).startswith("vllm:")
                ):
                    base = str(value.value)
                    names |= {base + suffix for suffix in SUFFIXES[kind]}
    return names


def dashboard_vllm_names() -> set[str]:
    return {
        name
        for path in DASHBOARDS.glob("*.json")
        for _, exprs in panels(json.loads(path.read_text()))
        for expr in exprs
        for name in metric_names(expr)
        if name.startswith("vllm:")
    }


def test_the_router_gauges_are_read_where_vllm_registers_them() -> None:
    registered = registered_by_vllm()
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_requests_running"} <= registered


def test_every_vllm_metric_a_dashboard_uses_is_registered_by_vllm() -> None:
    used = dashboard_vllm_names()
    assert used, "the dashboards show vLLM's queue and KV gauges beside pdserve's"
    assert sorted(used - registered_by_vllm()) == []
