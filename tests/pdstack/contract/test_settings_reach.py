"""Every serving setting of the stack reaches a component, and every KV channel setting a component has is one the
stack sets or one named here as set elsewhere: changing a stack value changes what pdstack renders for pdserve's
components (the contract) or for vLLM (both sides' command lines), so no setting is accepted and then ignored."""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from pdserve.kv.settings import KVChannelSettings
from pdstack.contract.components import contract
from pdstack.contract.serving_env import kv_channel
from pdstack.model import Engine, Model, PoolRole, Serving, Vllm
from pdstack.vllm.command import engine_args, engine_env

PDSERVE = Serving(model=Model(name="tiny", path="/var/lib/pdstack/models/tiny"))
VLLM = PDSERVE.model_copy(
    update={
        "engine": Engine.VLLM,
        "vllm": Vllm(
            image="localhost/pdstack-vllm-cpu:v0.32.0@sha256:" + "ab" * 32,
            version="0.32.0",
            dtype="float32",
            max_model_len=12288,
            block_size=32,
        ),
    }
)
SECTIONS = ("ports", "limits", "timeouts")
NOT_KNOBS = {"model", "engine", "vllm", "tracing"}  # sections of their own, checked where they are rendered
# KV channel settings no stack value sets: the key file and TLS files come from the deployment's secrets and
# certificates (pdstack.contract.components SECRET_FILES, kv_tls_settings); the listener's admission limits keep
# pdserve's defaults on every engine (docs/serving.md).
SET_ELSEWHERE = {
    "kv_key_file",
    "kv_host",
    "kv_tls_cert",
    "kv_tls_key",
    "kv_tls_ca",
    "kv_tls_server_name",
    "kv_store_bytes",
    "kv_handshake_timeout_seconds",
    "kv_max_handshakes",
    "kv_max_handshakes_per_address",
    "kv_max_connections",
    "kv_drop_log_seconds",
}


def rendered(serving: Serving) -> str:
    """What pdstack renders from `serving` for every component it runs (vLLM's too when it is the engine)."""
    parts: list[Any] = [repr(contract(serving))]
    if serving.engine is Engine.VLLM:
        for side in (PoolRole.PREFILL, PoolRole.DECODE):
            parts += [engine_args(serving, side, "10.0.0.7"), engine_env(serving, side, "10.0.0.7")]
    return json.dumps(parts, default=str)


def changed(value: Any, annotation: Any) -> Any:
    """Another valid value of a field."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5
    return next(choice for choice in get_args(annotation) if choice != value)


def knobs() -> list[tuple[str | None, str]]:
    """(section, field) of every scalar serving setting."""
    top = [(None, name) for name in Serving.model_fields if name not in NOT_KNOBS and name not in SECTIONS]
    nested = [(section, name) for section in SECTIONS for name in type(getattr(PDSERVE, section)).model_fields]
    return top + nested


def with_knob(serving: Serving, section: str | None, name: str) -> Serving:
    owner: BaseModel = serving if section is None else getattr(serving, section)
    value = changed(getattr(owner, name), type(owner).model_fields[name].annotation)
    if section is None:
        return serving.model_copy(update={name: value})
    return serving.model_copy(update={section: owner.model_copy(update={name: value})})


@pytest.mark.parametrize(("section", "name"), knobs(), ids=[f"{s or 'serving'}.{n}" for s, n in knobs()])
def test_every_stack_setting_reaches_a_component(section: str | None, name: str) -> None:
    reached = [
        serving.engine
        for serving in (PDSERVE, VLLM)
        if rendered(with_knob(serving, section, name)) != rendered(serving)
    ]
    assert reached, f"pdstack:serving.{f'{section}.' if section else ''}{name} changes nothing either engine runs with"


def test_every_kv_channel_setting_is_the_stacks_or_set_elsewhere() -> None:
    from_stack = kv_channel(PDSERVE).model_fields_set
    assert set(KVChannelSettings.model_fields) == from_stack | SET_ELSEWHERE
    assert not from_stack & SET_ELSEWHERE
