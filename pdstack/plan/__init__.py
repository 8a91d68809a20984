"""The capacity planner: KV sizes, prefill/decode timing, node counts, link need and the offload threshold.

It works from the hardware catalog (catalog.py: GPUs and instance types, which `pdstack validate` checks pools
against too) and model shapes (models.py), both data under pdstack/data/."""

from pdstack.plan.planner import Plan, PlanInputs, Slo, make_plan
from pdstack.plan.stacks import LinkCheck, link_checks, link_problems

__all__ = ["LinkCheck", "Plan", "PlanInputs", "Slo", "link_checks", "link_problems", "make_plan"]
