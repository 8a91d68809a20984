"""`pdstack validate` loads what each component is started with through the component's own settings model, and
names the stack setting of a value the stack model accepts but a component refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from pdserve.agent.settings import AgentSettings
from pdserve.common.settings import env_name, load_settings
from pdserve.gateway.settings import GatewaySettings
from pdserve.scheduler.settings import SchedulerSettings
from pdserve.server.settings import ServerSettings
from pdserve.vllm.settings import ConnectorConfig
from pdstack.contract.components import contract
from pdstack.contract.serving_env import stack_settings_of
from pdstack.model import Engine, PoolRole, Serving
from pdstack.stacks.component_settings import (
    MODELS,
    NODE_ADDRESS,
    NODE_SETTINGS,
    RELEASE,
    SCHEDULER_URL,
    from_env,
    from_flags,
)
from pdstack.stacks.files import load_stack_file
from pdstack.vllm.command import NodeTls, agent_args
from tests.support import STACKS
from tests.support.stackedit import edit, problems_of


def serving_of(env: str) -> Serving:
    serving = load_stack_file(STACKS / f"Pulumi.{env}-control.yaml").config.serving
    assert serving is not None
    return serving


def test_a_prefill_token_budget_pdserve_servers_cannot_take_is_refused(stacks_dir: Path) -> None:
    file = "Pulumi.local-control.yaml"
    edit(stacks_dir / file, lambda c: c["pdstack:serving"]["limits"].update(prefill_token_budget=8))
    assert problems_of(stacks_dir) == [
        f"{stacks_dir}/{file}: pdstack:serving.limits.prefill_token_budget: pdserve prefill, pdserve decode, "
        "pdserve colocated cannot take 8 as its prefill_token_budget: Input should be greater than or equal to 16"
    ]


def test_with_vllm_the_same_budget_is_vllms_to_take(stacks_dir: Path) -> None:
    """vLLM serves prefill and decode (--max-num-batched-tokens): pdserve's servers do not run there."""
    edit(
        stacks_dir / "Pulumi.dev-control.yaml",
        lambda c: c["pdstack:serving"]["limits"].update(prefill_token_budget=8),
    )
    assert problems_of(stacks_dir) == []


def test_a_tracing_endpoint_pdserve_cannot_parse_is_refused_in_a_vllm_stack(stacks_dir: Path) -> None:
    file = "Pulumi.prod-control.yaml"
    endpoint = "HTTPS://otel.example.com/v1/traces"  # the stack's URL check lower-cases the scheme; pdserve does not
    edit(stacks_dir / file, lambda c: c["pdstack:serving"].update(tracing={"otlp_endpoint": endpoint}))
    assert problems_of(stacks_dir) == [
        f"{stacks_dir}/{file}: pdstack:serving.tracing.otlp_endpoint: pdserve gateway, pdserve scheduler cannot take "
        f"'{endpoint}' as its otlp_traces_endpoint: String should match pattern '^https?://[^/\\s?#@]+(/[^\\s?#]*)?$'"
    ]


def stack_field(setting: str) -> FieldInfo:
    owner: Any = Serving
    *sections, name = setting.split(".")
    for section in sections:
        annotation = owner.model_fields[section].annotation
        owner = next(a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type))
    field: FieldInfo = owner.model_fields[name]
    return field


def admits(field: FieldInfo, value: Any) -> bool:
    try:
        TypeAdapter(Annotated[field.annotation, field]).validate_python(value)
    except ValidationError:
        return False
    return True


def boundary_values(*fields: FieldInfo) -> list[Any]:
    """Each field's bounds, a step either side of each (both as int and float), and its default."""
    bounds = [getattr(m, a) for f in fields for m in f.metadata for a in ("ge", "gt", "le", "lt") if hasattr(m, a)]
    near = [b + step for b in bounds for step in (-1, -1e-9, 0, 1e-9, 1)]
    return near + [round(v) for v in near] + [f.default for f in fields]


def looser_than(model: type[BaseModel]) -> dict[str, Any]:
    """The stack settings of `model`'s fields, each with a value its stack field admits and `model` refuses."""
    found: dict[str, Any] = {}
    for name, setting in stack_settings_of(model).items():
        ours, theirs = stack_field(setting), model.model_fields[name]
        refused = [v for v in boundary_values(ours, theirs) if admits(ours, v) and not admits(theirs, v)]
        if refused:
            found[setting] = max(refused)
    return found


@pytest.mark.parametrize(
    ("model", "refused"),
    [
        (GatewaySettings, {}),
        (SchedulerSettings, {}),
        (ServerSettings, {"limits.prefill_token_budget": 15}),
        (ConnectorConfig, {}),
    ],
    ids=lambda m: m.__name__ if isinstance(m, type) else "",
)
def test_the_stack_model_bounds_each_setting_as_its_component_does_but_the_known_few(
    model: type[BaseModel], refused: dict[str, Any]
) -> None:
    """Numeric bounds only (a pattern, like the tracing endpoint's, is validate's to check): the mapping from stack
    setting to component field is the one the contract renders with (stack_settings_of), so the values tried here are
    exactly what reaches each model; the connector's, vLLM's, take every value the stack admits."""
    assert looser_than(model) == refused


@pytest.mark.parametrize("env", ["local", "dev", "staging", "prod"])
def test_what_validate_loads_is_what_pdserve_loads(env: str) -> None:
    """from_env and from_flags read settings as pdserve's own loader does, for every example stack."""
    serving = serving_of(env)
    for component, settings in contract(serving).components.items():
        model = MODELS[component]
        node = {env_name(name): value for name, value in NODE_SETTINGS[component].items()}
        env_vars = {**settings.env(), **settings.tls_env(), **node}
        fixed = {"role": str(component)} if component.is_server else None
        loaded = load_settings(model, [], "pdserve", env_vars, fixed=fixed)
        assert loaded == model.model_validate({**from_env(model, env_vars), **(fixed or {})})
    if serving.engine is Engine.VLLM:
        args = agent_args(
            serving,
            PoolRole.PREFILL,
            advertise_host=NODE_ADDRESS,
            scheduler_url=SCHEDULER_URL,
            version=RELEASE,
            instance_id="prefill-1",
            tls=NodeTls(),
        )
        agent = load_settings(AgentSettings, list(args[1:]), "pdserve agent", {})
        assert agent == AgentSettings.model_validate(from_flags(args[1:]))
