"""Building blocks of pdstack's dashboards: Prometheus time series panels and the variables they filter on.

Built with grafana-foundation-sdk, whose builders are generated from Grafana's own dashboard schema, so a panel
field Grafana does not know is a type error here rather than a silently ignored key in Grafana.
"""

from __future__ import annotations

from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"
DC = 'datacenter=~"$datacenter"'
"""Every pdserve job carries the datacenter label (roles/prometheus, infra/prometheus.py)."""


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


def quantiles(histogram: str, by: str, selector: str = "", legend: str = "") -> list[Query]:
    """p50, p95 and p99 of a Prometheus histogram, per `by` label set."""
    matchers = f"{{{selector}}}" if selector else ""
    return [
        Query(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{matchers}[{RATE}])))",
            f"p{round(q * 100)} {legend}".strip(),
        )
        for q in (0.5, 0.95, 0.99)
    ]


def panel(title: str, unit: str, queries: list[Query], description: str, width: int = 12) -> timeseries.Panel:
    built = (
        timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).height(8).span(width)
    )
    for index, query in enumerate(queries):
        built = built.with_target(
            prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(chr(ord("A") + index)).range()
        )
    return built


def datasource_variable() -> dashboard.DatasourceVariable:
    return dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus")


def label_variable(name: str, label: str, query: str) -> dashboard.QueryVariable:
    """A multi-valued filter on a label's values, All (any value, also none) by default."""
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({query}, {name})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def board(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["pdstack"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .editable()
        .with_variable(datasource_variable())
    )


REQUESTS = "pdserve_gateway_requests_total"


def zero_if_none(expr: str) -> str:
    """Counters of rare events have no series until the first event: show 0, not "No data" (on (): only while the
    query returns nothing, not as an extra series beside its own)."""
    return f"({expr}) or on () vector(0)"
