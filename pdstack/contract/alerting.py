"""Alert routing: the Alertmanager configuration of an environment, rendered once from the stack model and run by
the local Alertmanager (roles/alertmanager, through playbooks/vars/contract/<env>.yml) and the cloud's
(infra/workloads/monitoring.py).

Alerts are grouped by name and datacenter and routed by their `severity` label (monitoring/alerts.yml sets one on
every rule): critical and warning each have a receiver of their own, which posts to the stack's webhook
(`pdstack:alerting.webhook_url`) when there is one and is otherwise empty, so the configuration is valid with no
webhook and every alert is still listed, and can be silenced, in Alertmanager. A datacenter whose link is down
inhibits that datacenter's KV and target-down alerts: one page for the cause, not one per symptom.

The webhook URL is written into the configuration itself (Debian's Alertmanager 0.25 has no `url_file`), so a
configuration with a webhook is treated as a secret wherever it is stored: a Kubernetes Secret, a file the role
writes with no_log and mode 0640.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdstack.model import webhook_url_problem

SEVERITIES = ("critical", "warning")
# The capacity plan as a series (monitoring/alerts.yml's PdstackThroughputBelowPlan compares generated tokens with
# it): one definition, plan_rules, for every Prometheus that loads the alerts.
PLAN_RECORD = "pdstack:plan_generation_tokens_per_second"
PLAN_GROUP = "pdstack-plan"
LINK_DOWN_ALERT = "PdstackDatacenterLinkDown"
# What a datacenter that cannot be reached also fires: its transfers fail and its targets are down.
INHIBITED_BY_LINK_DOWN = (
    "PdstackKVTransferFailures",
    "PdstackKVLoadFailures",
    "PdstackKVTransferSlow",
    "PdstackTargetDown",
)


@dataclass(frozen=True)
class Timing:
    """Alertmanager's grouping intervals (its own defaults are 30s, 5m, 4h); tests shorten them."""

    group_wait: str = "30s"
    group_interval: str = "5m"
    repeat_interval: str = "4h"
    critical_group_wait: str = "10s"  # a critical alert waits less for its group to fill
    critical_repeat_interval: str = "1h"


def receiver_name(env: str, severity: str) -> str:
    return f"pdstack-{env}-{severity}"


def default_receiver(env: str) -> str:
    """Alerts without a known severity: listed in Alertmanager, sent nowhere."""
    return f"pdstack-{env}"


def webhook_receivers(env: str) -> list[str]:
    """The receivers that post to the webhook when there is one."""
    return [receiver_name(env, severity) for severity in SEVERITIES]


WEBHOOK_CONFIG = {"send_resolved": True}  # each webhook_configs entry, besides its url


def _receiver(name: str, webhook_url: str | None) -> dict[str, Any]:
    if webhook_url is None:
        return {"name": name}
    return {"name": name, "webhook_configs": [{"url": webhook_url, **WEBHOOK_CONFIG}]}


def alertmanager_config(env: str, webhook_url: str | None = None, timing: Timing = Timing()) -> dict[str, Any]:
    """The environment's alertmanager.yml. `webhook_url` is the decrypted URL (None: no webhook)."""
    if webhook_url is not None:
        problem = webhook_url_problem(webhook_url, secret=True)
        if problem is not None:
            raise ValueError(f"pdstack:alerting.webhook_url: the URL {problem}")
    critical = {"group_wait": timing.critical_group_wait, "repeat_interval": timing.critical_repeat_interval}
    routes = [
        {
            "receiver": receiver_name(env, severity),
            "matchers": [f'severity="{severity}"'],
            **(critical if severity == "critical" else {}),
        }
        for severity in SEVERITIES
    ]
    return {
        "route": {
            "receiver": default_receiver(env),
            "group_by": ["alertname", "datacenter"],
            "group_wait": timing.group_wait,
            "group_interval": timing.group_interval,
            "repeat_interval": timing.repeat_interval,
            "routes": routes,
        },
        "inhibit_rules": [
            {
                "source_matchers": [f'alertname="{LINK_DOWN_ALERT}"'],
                "target_matchers": [f'alertname=~"{"|".join(INHIBITED_BY_LINK_DOWN)}"'],
                "equal": ["datacenter"],
            },
            # the same alert at warning while it is critical: the critical one says it all
            {
                "source_matchers": ['severity="critical"'],
                "target_matchers": ['severity="warning"'],
                "equal": ["alertname", "datacenter", "instance"],
            },
        ],
        "receivers": [
            _receiver(default_receiver(env), None),
            *(_receiver(name, webhook_url) for name in webhook_receivers(env)),
        ],
    }


def plan_generation_tokens_per_second(requests_per_second: float, mean_output_tokens: int) -> float:
    """The tokens per second the stack's capacity target (pdstack:capacity) plans decode to generate."""
    return float(requests_per_second) * mean_output_tokens


def plan_rules(tokens_per_second: float) -> dict[str, Any]:
    """The rule group recording the plan as PLAN_RECORD; empty when there is no plan (nothing to compare with)."""
    rules = [{"record": PLAN_RECORD, "expr": f"vector({float(tokens_per_second)!r})"}] if tokens_per_second > 0 else []
    return {"name": PLAN_GROUP, "rules": rules}


def rules_with_plan(alert_rules: dict[str, Any], tokens_per_second: float) -> dict[str, Any]:
    """The alerting rules (monitoring/alerts.yml, loaded) with the plan's group added: the one rules file a
    Prometheus that has no separate plan file loads (the cloud's)."""
    groups = [g for g in alert_rules["groups"] if g.get("name") != PLAN_GROUP]
    return {**alert_rules, "groups": [*groups, plan_rules(tokens_per_second)]}
