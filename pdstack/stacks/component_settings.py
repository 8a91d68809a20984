"""`pdstack validate` for what each component is started with: the control stack's `serving` rendered as the
contract renders it (pdserve's gateway, scheduler and servers; with vLLM, each side's PdstackConnector config and
agent), loaded through the component's own pydantic settings model as the component loads it at start-up. A value
the stack model accepts but a component refuses is a problem naming the stack setting it came from
(pdstack.contract.serving_env.stack_settings_of), e.g. `pdstack:serving.limits.prefill_token_budget`.

What only a node knows (its address, the scheduler's URL, the release) is given stand-ins of the form the roles
give, so a component's checks across fields see a whole configuration; TLS is on, as on every node with a certificate.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from pdserve.agent.settings import AgentSettings
from pdserve.common.settings import env_name
from pdserve.gateway.settings import GatewaySettings
from pdserve.scheduler.settings import SchedulerSettings
from pdserve.server.settings import ServerSettings
from pdserve.vllm.settings import ConnectorConfig
from pdstack.contract.components import Component, contract
from pdstack.contract.serving_env import stack_settings_of, stack_value
from pdstack.model import Engine, KvConnector, PoolRole, Serving
from pdstack.plan.stacks import control_of
from pdstack.stacks.files import Problem, StackFile
from pdstack.vllm.command import NodeTls, agent_args, connector_extra_config

NODE_ADDRESS = "10.0.0.7"
SCHEDULER_URL = f"https://{NODE_ADDRESS}:8100"
RELEASE = "v1"
SERVER_NODE = {
    "model": "/model",
    "advertise_host": NODE_ADDRESS,
    "engine_id": "0" * 24,
    "version": RELEASE,
    "scheduler_url": SCHEDULER_URL,
    "heartbeat_seconds": "1",
}
NODE_SETTINGS: Mapping[Component, Mapping[str, str]] = {
    Component.GATEWAY: {"scheduler_url": SCHEDULER_URL, "rate_limit_storage": f"rediss://{NODE_ADDRESS}:6379/0"},
    Component.SCHEDULER: {},
    Component.PREFILL: SERVER_NODE,
    Component.DECODE: SERVER_NODE,
    Component.COLOCATED: SERVER_NODE,
}
"""What roles/pdserve gives each component besides the contract (pdserve__env_node), as stand-ins."""
MODELS: Mapping[Component, type[BaseModel]] = {
    Component.GATEWAY: GatewaySettings,
    Component.SCHEDULER: SchedulerSettings,
    Component.PREFILL: ServerSettings,
    Component.DECODE: ServerSettings,
    Component.COLOCATED: ServerSettings,
}
VLLM_SIDES = (PoolRole.PREFILL, PoolRole.DECODE)


@dataclass(frozen=True)
class Refusal:
    """One value a component's settings model refuses: `field` is its setting ("" for a check across fields)."""

    component: str
    model: type[BaseModel]
    field: str
    value: Any
    message: str


def refusals(component: str, model: type[BaseModel], values: Mapping[str, Any]) -> list[Refusal]:
    try:
        model.model_validate(values)
    except ValidationError as error:
        return [
            Refusal(
                component,
                model,
                str(problem["loc"][0]) if problem["loc"] else "",
                problem.get("input"),
                problem["msg"].removeprefix("Value error, "),
            )
            for problem in error.errors()
        ]
    return []


def from_env(model: type[BaseModel], env: Mapping[str, str]) -> dict[str, str]:
    """The values pdserve's loader (pdserve.common.settings.load_settings) takes from PDSERVE_* variables."""
    return {name: env[env_name(name)] for name in model.model_fields if env_name(name) in env}


def from_flags(argv: Sequence[str]) -> dict[str, str]:
    """The values pdserve's loader takes from `--flag value` pairs."""
    return {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(argv[::2], argv[1::2], strict=True)}


def pdserve_refusals(serving: Serving) -> Iterator[Refusal]:
    """The contract's components, each as a node with TLS runs it; pdserve's servers only where they are the
    engine."""
    servers = serving.engine is Engine.PDSERVE
    for component, settings in contract(serving).components.items():
        if component.is_server and not servers:
            continue
        model = MODELS[component]
        env = {**settings.env(), **settings.tls_env()}
        values = {**NODE_SETTINGS[component], **from_env(model, env)}
        if component.is_server:
            values["role"] = str(component)  # `pdserve ROLE` fixes it (ComponentContract.args)
        yield from refusals(f"pdserve {component}", model, values)


def vllm_refusals(serving: Serving) -> Iterator[Refusal]:
    """Each side's PdstackConnector config (as ConnectorSettings.of checks it) and agent, with the node's TLS."""
    if serving.engine is not Engine.VLLM or serving.vllm is None or serving.vllm.kv_connector is KvConnector.NIXL:
        return
    tls = NodeTls(mutual=serving.mutual_tls)
    for side in VLLM_SIDES:
        extra = connector_extra_config(serving, side, NODE_ADDRESS, tls, RELEASE)
        yield from refusals(f"vLLM {side}'s connector", ConnectorConfig, extra)
        args = agent_args(
            serving,
            side,
            advertise_host=NODE_ADDRESS,
            scheduler_url=SCHEDULER_URL,
            version=RELEASE,
            instance_id=f"{side}-1",
            tls=tls,
        )
        yield from refusals(f"{side}'s agent", AgentSettings, from_flags(args[1:]))


def component_problems(where: str, serving: Serving) -> list[Problem]:
    """One problem per refused value, naming the stack setting it came from and every component refusing it."""
    refused: dict[tuple[str, str], list[str]] = defaultdict(list)
    for refusal in (*pdserve_refusals(serving), *vllm_refusals(serving)):
        setting = stack_settings_of(refusal.model).get(refusal.field)
        value = stack_value(serving, setting) if setting else refusal.value
        path = f"pdstack:serving.{setting}" if setting else "pdstack:serving"
        field = f" as its {refusal.field}" if refusal.field else ""
        refused[path, f"cannot take {value!r}{field}: {refusal.message}"].append(refusal.component)
    return [Problem(where, path, f"{', '.join(who)} {what}") for (path, what), who in refused.items()]


def settings_problems(stacks: list[StackFile]) -> list[Problem]:
    control = control_of(stacks)
    if control is None or control.config.serving is None:
        return []
    return component_problems(str(control.path), control.config.serving)
