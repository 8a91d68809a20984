"""pdstack:serving.tracing: off unless set; when set, every pdserve component of the contract reads the same
endpoint, ratio and prompt switch through its own settings loader; a bad endpoint is refused naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.gateway.settings import GatewaySettings
from pdserve.scheduler.settings import SchedulerSettings
from pdserve.server.settings import ServerSettings
from pdstack.contract.components import Component, contract
from pdstack.model import Model, Serving, Tracing

ENDPOINT = "http://collector.internal:4318/v1/traces"
TRACING_VARIABLES = {"PDSERVE_OTLP_TRACES_ENDPOINT", "PDSERVE_TRACE_SAMPLE_RATIO", "PDSERVE_TRACE_PROMPTS"}


def serving(**tracing: object) -> Serving:
    return Serving(model=Model(name="m", path="/m"), tracing=Tracing.model_validate(tracing) if tracing else None)


def test_without_the_section_no_component_gets_a_tracing_variable() -> None:
    rendered = contract(serving())
    for component in Component:
        assert set(rendered[component].env()) & TRACING_VARIABLES == set()


REQUIRED = {
    GatewaySettings: {
        "scheduler_url": "http://s:1",
        "scheduler_token_file": "/t",
        "server_token_file": "/t",
        "api_keys_file": "/k",
    },
    ServerSettings: {"role": "decode", "model": "/m", "kv_key_file": "/k", "api_token_file": "/t"},
    SchedulerSettings: {"state_file": "/s", "admin_token_file": "/a", "identity_key_file": "/i"},
}
MODEL = {Component.GATEWAY: GatewaySettings, Component.SCHEDULER: SchedulerSettings}


@pytest.mark.parametrize("component", list(Component))
def test_every_component_on_a_request_path_reads_the_stacks_tracing(component: Component) -> None:
    env = contract(serving(otlp_endpoint=ENDPOINT, sample_ratio=0.25))[component].env()
    model = MODEL.get(component, ServerSettings)
    values = {
        name: env[f"PDSERVE_{name.upper()}"] for name in ("otlp_traces_endpoint", "trace_sample_ratio", "trace_prompts")
    }
    parsed = model.model_validate({**values, **REQUIRED[model]})
    assert (parsed.otlp_traces_endpoint, parsed.trace_sample_ratio, parsed.trace_prompts) == (ENDPOINT, 0.25, False)


@pytest.mark.parametrize(
    "url",
    [
        "collector:4318",
        "ftp://collector/v1/traces",
        "http://user:pw@collector/v1/traces",
        "http://collector/v1/traces?token=x",
    ],
)
def test_a_bad_endpoint_is_refused_naming_the_field(url: str) -> None:
    with pytest.raises(ValidationError, match="otlp_endpoint"):
        serving(otlp_endpoint=url)


def test_the_ratio_must_be_a_share() -> None:
    with pytest.raises(ValidationError, match="sample_ratio"):
        serving(otlp_endpoint=ENDPOINT, sample_ratio=0)
