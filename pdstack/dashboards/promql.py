"""What the tests need to read a dashboard's queries: the metric names each uses, and the query Grafana would send
once it has substituted the dashboard's variables."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
}
VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$datacenter": ".*", "$instance": ".*", "$link_gbit": "1"}
"""A value for each variable the dashboards use, as Grafana would substitute it (All is the regex .*)."""


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label names (in
    matchers or grouping clauses), durations or variables."""
    bare = _GROUPING.sub(" ", _RANGE.sub(" ", _MATCHERS.sub(" ", _STRING.sub('""', expr))))
    return {name for name in _IDENTIFIER.findall(bare) if name.lower() not in _KEYWORDS}


def expand(expr: str, values: Mapping[str, str] = VARIABLES) -> str:
    """The query with every dashboard variable substituted (longest names first); raises on an unknown one."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    if "$" in expr:
        raise ValueError(f"unknown dashboard variable in {expr!r}")
    return expr


def panels(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, list[str]]]:
    """(title, [expr, ...]) of every panel of a dashboard's JSON model, rows included."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panels(panel)
            continue
        yield panel["title"], [target["expr"] for target in panel.get("targets", [])]
