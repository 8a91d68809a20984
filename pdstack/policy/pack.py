"""The pulumi-policy registrations of the rules (rules.py): every rule mandatory, the KV port configurable."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    Policy,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from pdstack.policy import core, rules

PACK_NAME = "pdstack"
CONFIG_SCHEMA = PolicyConfigSchema(
    properties={
        "kvPort": {"type": "integer", "default": 8400, "description": "the environment's first KV channel port"},
        "kvPortLast": {"type": "integer", "description": "its last KV port (a vLLM prefill: one per worker)"},
        "protectStateful": {
            "type": "boolean",
            "default": True,
            "description": "stateful resources must be protected (false only for a dev stack with protect off)",
        },
    }
)


def _config(raw: Mapping[str, Any]) -> core.PolicyConfig:
    return core.PolicyConfig.from_pack_config(raw)


def resource_policy(rule: core.ResourceRule) -> ResourceValidationPolicy:
    def validate(args: ResourceValidationArgs, report_violation: ReportViolation) -> None:
        for message in rule.check(args.resource_type, dict(args.props), _config(args.get_config())):
            report_violation(message, None)

    return ResourceValidationPolicy(
        name=rule.name,
        description=rule.description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
        config_schema=CONFIG_SCHEMA,
    )


def stack_policy(rule: core.StackRule) -> StackValidationPolicy:
    def validate(args: StackValidationArgs, report_violation: ReportViolation) -> None:
        graph = [
            core.PolicyResource(
                r.resource_type,
                r.name,
                r.urn,
                dict(r.props),
                r.parent.urn if r.parent else "",
                protect=bool(r.opts.protect),
            )
            for r in args.resources
        ]
        for resource, message in rule.check(graph, _config(args.get_config())):
            report_violation(message, resource.urn)

    return StackValidationPolicy(
        name=rule.name,
        description=rule.description,
        validate=validate,
        enforcement_level=EnforcementLevel.MANDATORY,
        config_schema=CONFIG_SCHEMA,
    )


def policies() -> list[Policy]:
    return [*map(resource_policy, rules.RESOURCE_RULES), *map(stack_policy, rules.STACK_RULES)]
