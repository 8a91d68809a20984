"""Helpers the connector's tests share beyond tests/vllm/conftest.py: params signed as the system would sign them."""

from __future__ import annotations

from typing import Any

from pdserve.kv.params import derive_params_key, sign
from tests.vllm.conftest import Pair


def early_dispatch_params(pair: Pair, transfer_id: str, kv_fingerprint: str) -> dict[str, Any]:
    """Decode's kv_transfer_params as the gateway signs them for early dispatch (design note: streaming)."""
    return sign(
        derive_params_key(pair.key.material),
        {
            "do_remote_prefill": True,
            "remote_request_id": transfer_id,
            "remote_engine_id": "prefill",
            "remote_host": "127.0.0.1",
            "remote_port": pair.kv_port,
            "remote_block_ids": None,
            "kv_fingerprint": kv_fingerprint,
            "pdstack_streamed": True,
        },
    )
