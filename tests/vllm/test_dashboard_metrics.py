"""The vllm: metrics the dashboards read are ones vLLM registers, with the sample names Prometheus stores.

The main suite checks every other name against the components' scrapes (tests/pdserve/gateway/
test_dashboard_queries.py); vLLM is importable only here. The names come from vLLM's own metric registrations
(the `name=` of each gauge, counter and histogram its loggers create), read from the installed package.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pdstack.dashboards.promql import metric_names, panels
from tests.support import REPO

DASHBOARDS = REPO / "monitoring" / "dashboards"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


# Run in a fresh interpreter: CPython 3.11.7's ast.parse can fail with "SystemError: AST constructor recursion depth
# mismatch" once earlier tests in the same process have left its recursion counter off (seen in a CI rehearsal;
# CPython gh-106905, fixed in 3.11.8 and 3.12).
SCAN = r"""
import ast, json, sys
from pathlib import Path
import vllm
suffixes = json.loads(sys.argv[1])
root = Path(vllm.__file__).parent
names = set()
for path in [*(root / "v1" / "metrics").rglob("*.py"), *(root / "distributed" / "kv_transfer").rglob("*.py")]:
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        kind = next((k for k in suffixes if k in func.lower()), None)
        for keyword in node.keywords:
            value = keyword.value
            named = keyword.arg == "name" and isinstance(value, ast.Constant)
            if kind and named and str(value.value).startswith("vllm:"):
                names |= {str(value.value) + suffix for suffix in suffixes[kind]}
print(json.dumps(sorted(names)))
"""


def registered_by_vllm() -> set[str]:
    """Sample names of every vllm: metric created in vLLM's metrics and KV-connector code."""
    scanned = subprocess.run(
        [sys.executable, "-c", SCAN, json.dumps(SUFFIXES)], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(scanned.stdout))


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
