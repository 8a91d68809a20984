"""The stack's serving settings as the PDSERVE_* variables the pdserve containers read (the pdserve role's
`pdserve_env`): one source of truth for limits, timeouts and routing, whichever environment deploys them."""

from __future__ import annotations

from pdstack.model import Serving


def pdserve_env(serving: Serving) -> dict[str, str]:
    """Every component gets the same map; each reads only the variables of its own settings."""
    limits, timeouts = serving.limits, serving.timeouts
    settings: dict[str, object] = {
        # gateway
        "OFFLOAD_THRESHOLD_TOKENS": serving.offload_threshold_tokens,
        "MAX_PROMPT_TOKENS": limits.max_prompt_tokens,
        "MAX_TOKENS_LIMIT": limits.max_output_tokens,
        "CONNECT_TIMEOUT": timeouts.connect_s,
        "PREFILL_TIMEOUT": timeouts.prefill_s,
        "FIRST_TOKEN_TIMEOUT": timeouts.first_token_s,
        "DECODE_TIMEOUT": timeouts.request_s,
        # prefill and decode servers
        "MAX_NUM_SEQS": limits.max_concurrency,
        "PREFILL_TOKEN_BUDGET": limits.prefill_token_budget,
        "KV_STREAMS": serving.kv_streams,
        "KV_LEASE_SECONDS": timeouts.kv_lease_s,
        "KV_READ_TIMEOUT_SECONDS": timeouts.kv_transfer_s,
        "KV_LOAD_FAILURE_POLICY": serving.kv_load_failure_policy,
    }
    return {f"PDSERVE_{name}": str(value) for name, value in settings.items()}
