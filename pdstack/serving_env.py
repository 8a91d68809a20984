"""The stack's serving settings (limits, timeouts, routing) as the PDSERVE_* variables each pdserve component reads.

pdstack.contract folds these into each component's settings next to its ports and secret files; every name is a
field of the component's pdserve settings model (tests/pdstack/test_contract.py parses them with pdserve's loaders).
"""

from __future__ import annotations

from pdstack.model import Serving


def _as_env(settings: dict[str, object]) -> dict[str, str]:
    return {f"PDSERVE_{name}": str(value) for name, value in settings.items()}


def tracing_settings(serving: Serving) -> dict[str, str]:
    """Every component's tracing (pdserve.common.tracing.TracingSettings); none without `serving.tracing`."""
    tracing = serving.tracing
    if tracing is None:
        return {}
    return _as_env(
        {
            "OTLP_TRACES_ENDPOINT": tracing.otlp_endpoint,
            "TRACE_SAMPLE_RATIO": tracing.sample_ratio,
            "TRACE_PROMPTS": str(tracing.include_prompts).lower(),
        }
    )


def gateway_settings(serving: Serving) -> dict[str, str]:
    limits, timeouts = serving.limits, serving.timeouts
    plaintext = _as_env({"ALLOW_PLAINTEXT": "true"}) if serving.allow_plaintext else {}
    return tracing_settings(serving) | plaintext | _as_env({
        "OFFLOAD_THRESHOLD_TOKENS": serving.offload_threshold_tokens,
        "MAX_PROMPT_TOKENS": limits.max_prompt_tokens,
        "MAX_TOKENS_LIMIT": limits.max_output_tokens,
        "CONNECT_TIMEOUT": timeouts.connect_s,
        "PREFILL_TIMEOUT": timeouts.prefill_s,
        "FIRST_TOKEN_TIMEOUT": timeouts.first_token_s,
        "DECODE_TIMEOUT": timeouts.request_s,
    })  # fmt: skip


def server_settings(serving: Serving) -> dict[str, str]:
    """Prefill, decode and colocated servers."""
    limits, timeouts = serving.limits, serving.timeouts
    return tracing_settings(serving) | _as_env({
        "MAX_NUM_SEQS": limits.max_concurrency,
        "PREFILL_TOKEN_BUDGET": limits.prefill_token_budget,
        "KV_STREAMS": serving.kv_streams,
        "KV_LEASE_SECONDS": timeouts.kv_lease_s,
        "KV_READ_TIMEOUT_SECONDS": timeouts.kv_transfer_s,
        "KV_LOAD_FAILURE_POLICY": serving.kv_load_failure_policy,
    })  # fmt: skip


def pdserve_env(serving: Serving) -> dict[str, str]:
    """Every component's settings in one map (each component reads only the variables of its own settings)."""
    return gateway_settings(serving) | server_settings(serving)
