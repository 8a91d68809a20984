"""Every alerting rule's inputs exist where it runs: each metric a rule reads is one the components of its engine
register (pdserve: gateway, scheduler, pdserve's servers and KV channel; vLLM: gateway, scheduler, vLLM and the
PdstackConnector's metrics in vLLM's API server), or node_exporter's, the node bootstrap's textfile metric, `up`, or a
recording rule. A rule read by one engine only names it in its `engine` annotation (monitoring/alerts.yml).

The registries are read from the code, as the dashboard checks read them, without starting anything: pdserve's
from its metric constructors (serving/pdserve), vLLM's with tests/vllm/test_dashboard_metrics.py's scan of the
installed vLLM package, run by the vLLM environment's interpreter (.venv-vllm, `make vllm-venv`)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from pdserve.common.registry import component_registry
from pdstack.contract.alerting import PLAN_RECORD, plan_generation_tokens_per_second, plan_rules, rules_with_plan
from pdstack.dashboards.promql import metric_names
from tests.support import REPO
from tests.vllm.test_dashboard_metrics import SCAN, SUFFIXES

RULES = REPO / "monitoring" / "alerts.yml"
PDSERVE = REPO / "serving" / "pdserve"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ENGINES = ("pdserve", "vllm")
# The pdserve packages whose processes run in a fleet of each engine: a vLLM fleet runs vLLM (with pdserve.vllm's
# connector metrics in its API server) in place of pdserve's servers and their KV channel.
COMPONENTS = {
    "pdserve": ("gateway", "scheduler", "server", "kv"),
    "vllm": ("gateway", "scheduler", "vllm"),
}
# node_exporter's (its meminfo and timex collectors, on every node of both engines), and Prometheus' own `up`.
NODE_EXPORTER = {"node_memory_MemAvailable_bytes", "node_timex_offset_seconds", "node_timex_sync_status"}
NODE_TEXTFILE = REPO / "pdstack" / "node" / "loader.py"  # writes pdstack_node_bootstrap_failed (# TYPE lines)


def sample_names(name: str, kind: str) -> set[str]:
    base = name.removesuffix("_total") if kind == "counter" else name
    return {base + suffix for suffix in SUFFIXES[kind]}


@cache
def process_series() -> frozenset[str]:
    """What pdserve.common.registry.component_registry() holds before its component registers anything."""
    return frozenset(sample.name for family in component_registry().collect() for sample in family.samples)


def constructed(path: Path) -> set[str]:
    """Sample names of the metrics a module constructs: Counter/Gauge/Histogram calls (or factories named after
    them) with the name as first argument or `name=`, and the process series of a component_registry() it makes."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func == component_registry.__name__:
            names |= process_series()
            continue
        kind = next((k for k in SUFFIXES if k in func.lower()), None)
        if kind is None:
            continue
        args = [node.args[0]] if node.args else []
        args += [k.value for k in node.keywords if k.arg == "name"]
        for arg in args:
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("pdserve_"):
                names |= sample_names(str(arg.value), kind)
    return names


@cache
def registered_by_pdserve(component: str) -> frozenset[str]:
    return frozenset(n for path in (PDSERVE / component).rglob("*.py") for n in constructed(path))


@cache
def registered_by_vllm() -> frozenset[str]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make vllm-venv) to read vLLM's registrations from")
    scanned = subprocess.run(
        [str(VLLM_PYTHON), "-c", SCAN, json.dumps(SUFFIXES)], capture_output=True, text=True, check=True, timeout=120
    )
    return frozenset(json.loads(scanned.stdout))


def node_textfile_names() -> set[str]:
    return set(re.findall(r"# TYPE (\w+) ", NODE_TEXTFILE.read_text()))


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def recorded() -> set[str]:
    # the rules' own recordings, and the capacity plan's (pdstack:plan_generation_tokens_per_second)
    return {rule["record"] for rule in rules() if "record" in rule} | {PLAN_RECORD}


def available(engine: str) -> set[str]:
    names = {n for component in COMPONENTS[engine] for n in registered_by_pdserve(component)}
    if engine == "vllm":
        names |= registered_by_vllm()
    return names | NODE_EXPORTER | node_textfile_names() | {"up"} | recorded()


@pytest.mark.parametrize("engine", ENGINES)
def test_every_rule_for_an_engine_reads_only_metrics_its_components_register(engine: str) -> None:
    have = available(engine)
    missing = {
        rule.get("alert") or rule["record"]: sorted(metric_names(rule["expr"]) - have)
        for rule in rules()
        if rule.get("annotations", {}).get("engine", engine) == engine
    }
    assert {name: names for name, names in missing.items() if names} == {}


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_has_every_symptom_alert(engine: str) -> None:
    """An alert one engine's rule covers, the other engine covers too (with its own metric names), unless its
    inputs exist only for one engine by nature (vLLM's data-parallel ranks)."""
    by_engine: dict[str, set[str]] = {e: set() for e in ENGINES}
    for rule in rules():
        if "alert" in rule:
            engine_of = rule.get("annotations", {}).get("engine")
            for e in [engine_of] if engine_of else ENGINES:
                by_engine[e].add(rule["alert"])
    only_vllm = {"PdstackEngineRankLoadSkew"}
    other = next(e for e in ENGINES if e != engine)
    assert by_engine[other] - by_engine[engine] - only_vllm == set()
    assert {"PdstackDecodeKVMemoryLeak", "PdstackThroughputBelowPlan"} <= by_engine[engine]


def test_the_registries_are_read() -> None:
    """The scan finds what it should, so an empty registry cannot pass the check above."""
    assert "pdserve_kv_memory_reserved_bytes" in registered_by_pdserve("server")
    assert "pdserve_gateway_requests_total" in registered_by_pdserve("gateway")
    assert "pdserve_kv_transfer_failures_total" in registered_by_pdserve("vllm")  # the connector's, in vLLM
    assert "pdserve_kv_memory_reserved_bytes" not in available("vllm")
    assert "pdstack_node_bootstrap_failed" in node_textfile_names()


@pytest.mark.parametrize("tokens_per_second", [1536.0, 0.0])
def test_the_local_plan_rule_is_the_contracts_plan_rule(tokens_per_second: float) -> None:
    """roles/prometheus writes the plan group the local Prometheus loads; pdstack/contract/alerting.py's plan_rules
    is the definition every other Prometheus gets (rules_with_plan): the two render the same group."""
    template = (REPO / "roles" / "prometheus" / "templates" / "plan.yml.j2").read_text()
    rendered = jinja2.Template(template).render(
        ansible_managed="managed", prometheus_plan_generation_tokens_per_second=tokens_per_second
    )
    (group,) = yaml.safe_load(rendered)["groups"]
    assert group == plan_rules(tokens_per_second)


def test_the_plan_joins_the_alerting_rules_once() -> None:
    alerts = yaml.safe_load(RULES.read_text())
    merged = rules_with_plan(rules_with_plan(alerts, 1536), 1536)
    assert [g["name"] for g in merged["groups"]] == [*(g["name"] for g in alerts["groups"]), "pdstack-plan"]
    assert merged["groups"][-1]["rules"] == [{"record": PLAN_RECORD, "expr": "vector(1536.0)"}]
    assert plan_generation_tokens_per_second(3, 512) == 1536
