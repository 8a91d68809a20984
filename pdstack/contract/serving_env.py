"""The stack's serving settings (limits, timeouts, routing, the KV channel, tracing) as the PDSERVE_* variables each
pdserve component reads: values by field name of the component's own pdserve settings model, rendered by pdserve's
own naming function (pdserve.common.settings.as_env, which refuses a name the model lacks).

pdstack.contract.components folds these into each component's settings next to its ports and secret files.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pdserve.common import settings as pdserve_settings
from pdserve.common.tracing import TracingSettings
from pdserve.gateway.settings import GatewaySettings
from pdserve.kv.settings import KVChannelSettings
from pdserve.server.settings import ServerSettings
from pdstack.model import Serving


def as_env(model: type[BaseModel], values: dict[str, Any]) -> dict[str, str]:
    """pdserve's own rendering of settings as PDSERVE_* variables (pdserve.common.settings.as_env)."""
    env: dict[str, str] = pdserve_settings.as_env(model, values)
    return env


def tracing_settings(serving: Serving) -> dict[str, str]:
    """Every component's tracing (pdserve.common.tracing.TracingSettings); none without `serving.tracing`."""
    tracing = serving.tracing
    if tracing is None:
        return {}
    return as_env(
        TracingSettings,
        {
            "otlp_traces_endpoint": tracing.otlp_endpoint,
            "trace_sample_ratio": tracing.sample_ratio,
            "trace_prompts": tracing.include_prompts,
        },
    )


def gateway_settings(serving: Serving) -> dict[str, str]:
    limits, timeouts = serving.limits, serving.timeouts
    plaintext = {"allow_plaintext": True} if serving.allow_plaintext else {}
    return tracing_settings(serving) | as_env(
        GatewaySettings,
        {
            **plaintext,
            "offload_threshold_tokens": serving.offload_threshold_tokens,
            "max_prompt_tokens": limits.max_prompt_tokens,
            "max_output_tokens": limits.max_output_tokens,
            "connect_timeout": timeouts.connect_s,
            "prefill_timeout": timeouts.prefill_s,
            "first_token_timeout": timeouts.first_token_s,
            "request_timeout": timeouts.request_s,
        },
    )


def kv_channel(serving: Serving) -> KVChannelSettings:
    """The stack's KV channel knobs, under pdserve's names: what both engines get, on both sides (pdserve's servers
    as PDSERVE_* variables, vLLM's PdstackConnector as kv_connector_extra_config, pdstack.vllm.command)."""
    timeouts = serving.timeouts
    return KVChannelSettings(
        kv_port=serving.ports.kv,
        kv_streams=serving.kv_streams,
        kv_lease_seconds=timeouts.kv_lease_s,
        kv_connect_timeout_seconds=timeouts.connect_s,
        kv_read_timeout_seconds=timeouts.kv_read_s,
        kv_transfer_timeout_seconds=timeouts.kv_transfer_s,
    )


def server_settings(serving: Serving, *, kv: bool) -> dict[str, str]:
    """Prefill and decode servers (`kv`: with the KV channel's settings), and colocated ones (without); each serves
    the model under the name clients ask for, as vLLM does (pdstack.vllm.command)."""
    limits = serving.limits
    channel = kv_channel(serving).model_dump(exclude_unset=True) if kv else {}
    return tracing_settings(serving) | as_env(
        ServerSettings,
        {
            "served_model_name": serving.model.name,
            "max_num_seqs": limits.max_concurrency,
            "prefill_token_budget": limits.prefill_token_budget,
            "kv_load_failure_policy": serving.kv_load_failure_policy,
            **channel,
        },
    )
