"""The stack's serving settings (limits, timeouts, routing, the KV channel, tracing) as the PDSERVE_* variables each
pdserve component reads: values by field name of the component's own pdserve settings model, rendered by pdserve's
own naming function (pdserve.common.settings.as_env, which refuses a name the model lacks).

Each model's fields set from the stack are one map, field name -> the stack setting under `serving` it takes
(FROM_STACK): the rendering reads the values through it, and `pdstack validate` names the stack setting a component
refuses through it (pdstack.stacks.component_settings). pdstack.contract.components folds these into each
component's settings next to its ports and secret files.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import reduce
from typing import Any

from pydantic import BaseModel

from pdserve.common import settings as pdserve_settings
from pdserve.common.tracing import TracingSettings
from pdserve.gateway.settings import GatewaySettings
from pdserve.kv.settings import KVChannelSettings
from pdserve.server.settings import ServerSettings
from pdstack.model import Serving

TRACING_FROM_STACK = {
    "otlp_traces_endpoint": "tracing.otlp_endpoint",
    "trace_sample_ratio": "tracing.sample_ratio",
    "trace_prompts": "tracing.include_prompts",
}
GATEWAY_FROM_STACK = {
    "allow_plaintext": "allow_plaintext",
    "offload_threshold_tokens": "offload_threshold_tokens",
    "max_prompt_tokens": "limits.max_prompt_tokens",
    "max_output_tokens": "limits.max_output_tokens",
    "connect_timeout": "timeouts.connect_s",
    "prefill_timeout": "timeouts.prefill_s",
    "first_token_timeout": "timeouts.first_token_s",
    "request_timeout": "timeouts.request_s",
}
KV_CHANNEL_FROM_STACK = {
    "kv_port": "ports.kv",
    "kv_streams": "kv_streams",
    "kv_lease_seconds": "timeouts.kv_lease_s",
    "kv_connect_timeout_seconds": "timeouts.connect_s",
    "kv_read_timeout_seconds": "timeouts.kv_read_s",
    "kv_transfer_timeout_seconds": "timeouts.kv_transfer_s",
}
SERVER_FROM_STACK = {
    "served_model_name": "model.name",  # as vLLM's --served-model-name (pdstack.vllm.command)
    "max_num_seqs": "limits.max_concurrency",
    "prefill_token_budget": "limits.prefill_token_budget",
    "kv_load_failure_policy": "kv_load_failure_policy",
}
FROM_STACK: Mapping[type[BaseModel], Mapping[str, str]] = {
    TracingSettings: TRACING_FROM_STACK,
    GatewaySettings: GATEWAY_FROM_STACK,
    KVChannelSettings: KV_CHANNEL_FROM_STACK,
    ServerSettings: SERVER_FROM_STACK,
}
"""Per pdserve settings model, the fields it declares that the stack sets, each with the setting under `serving` it
comes from (a model inherits its bases': stack_settings_of)."""


def stack_settings_of(model: type[BaseModel]) -> dict[str, str]:
    """Every field of `model` the stack sets (its own and its bases'), with the setting under `serving` it takes."""
    return {name: setting for cls in model.__mro__ for name, setting in FROM_STACK.get(cls, {}).items()}


def stack_value(serving: Serving, setting: str) -> Any:
    """The value of a setting under `serving`, by its dotted path (`timeouts.kv_read_s`)."""
    return reduce(getattr, setting.split("."), serving)


def from_stack(serving: Serving, fields: Mapping[str, str]) -> dict[str, Any]:
    return {name: stack_value(serving, setting) for name, setting in fields.items()}


def as_env(model: type[BaseModel], values: dict[str, Any]) -> dict[str, str]:
    """pdserve's own rendering of settings as PDSERVE_* variables (pdserve.common.settings.as_env)."""
    env: dict[str, str] = pdserve_settings.as_env(model, values)
    return env


def tracing_settings(serving: Serving) -> dict[str, str]:
    """Every component's tracing (pdserve.common.tracing.TracingSettings); none without `serving.tracing`."""
    if serving.tracing is None:
        return {}
    return as_env(TracingSettings, from_stack(serving, TRACING_FROM_STACK))


def gateway_settings(serving: Serving) -> dict[str, str]:
    values = from_stack(serving, GATEWAY_FROM_STACK)
    if not serving.allow_plaintext:  # pdserve's default: rendered only where the stack says otherwise
        del values["allow_plaintext"]
    return tracing_settings(serving) | as_env(GatewaySettings, values)


def kv_channel(serving: Serving) -> KVChannelSettings:
    """The stack's KV channel knobs, under pdserve's names: what both engines get, on both sides (pdserve's servers
    as PDSERVE_* variables, vLLM's PdstackConnector as kv_connector_extra_config, pdstack.vllm.command)."""
    return KVChannelSettings(**from_stack(serving, KV_CHANNEL_FROM_STACK))


def server_settings(serving: Serving, *, kv: bool) -> dict[str, str]:
    """Prefill and decode servers (`kv`: with the KV channel's settings), and colocated ones (without); each serves
    the model under the name clients ask for, as vLLM does (pdstack.vllm.command)."""
    channel = kv_channel(serving).model_dump(exclude_unset=True) if kv else {}
    return tracing_settings(serving) | as_env(ServerSettings, {**from_stack(serving, SERVER_FROM_STACK), **channel})
