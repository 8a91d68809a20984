"""The KV fingerprint: everything that must agree for one vLLM instance's raw KV blocks to be valid in another's.

The connector moves whole paged blocks as bytes, so any difference in model, dtype, block size, heads, head size,
attention backend or (on CPU) the kernel ISA that packs K and V inside a block would decode garbage. Prefill sends
its fields in kv_transfer_params; decode compares them field by field (so the refusal names the field) and the
KV blob carries their hash (so the KV server's manifest is checked too).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.platforms import current_platform

CONNECTOR_VERSION = "3"  # 3: KV channel protocol v4 (a pull's streams share its chunks; v3 peers are refused)
FIELDS = (
    "vllm_version",
    "connector_version",
    "model",
    "kv_dtype",
    "block_size",
    "kv_heads",
    "head_size",
    "num_layers",
    "block_shape",
    "attention_backend",
    "cpu_isa",
    "tensor_parallel_size",
)


class FingerprintMismatch(ValueError):
    def __init__(self, field: str, theirs: Any, ours: Any) -> None:
        super().__init__(
            f"kv_transfer_params.kv_fingerprint_fields.{field}: prefill's KV has {field}={theirs!r}, this decode "
            f"instance has {ours!r} (the raw KV blocks are not compatible)"
        )
        self.field = field


def digest(fields: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def compare(theirs: Any, ours: dict[str, Any]) -> None:
    """Raise FingerprintMismatch naming the first field that differs (or is missing)."""
    if not isinstance(theirs, dict):
        raise FingerprintMismatch("*", theirs, "a JSON object of fields")
    for field in FIELDS:
        if theirs.get(field) != ours.get(field):
            raise FingerprintMismatch(field, theirs.get(field), ours.get(field))


def model_identity(vllm_config: Any) -> str:
    """The model's config (without its local path) and revision: same weights config, same identity.

    A weights checksum would be stronger; hashing gigabytes at every start is not worth it until the scheduler can
    carry a checksum computed once at publish time.
    """
    model_config = vllm_config.model_config
    config = model_config.hf_config.to_dict()
    config.pop("_name_or_path", None)
    config.pop("transformers_version", None)
    body = json.dumps({"config": config, "revision": model_config.revision}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def compute(vllm_config: Any, kv_caches: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint of this worker, from its config and its registered KV tensors (called in the worker)."""
    model_config, parallel_config = vllm_config.model_config, vllm_config.parallel_config
    first = next(iter(kv_caches.values()))
    backends = sorted(backend.get_name() for backend in get_current_attn_backends(vllm_config))
    return {
        "vllm_version": vllm.__version__,
        "connector_version": CONNECTOR_VERSION,
        "model": model_identity(vllm_config),
        "kv_dtype": f"{first.dtype}/{vllm_config.cache_config.cache_dtype}",
        "block_size": int(vllm_config.cache_config.block_size),
        "kv_heads": int(model_config.get_num_kv_heads(parallel_config)),
        "head_size": int(model_config.get_head_size()),
        "num_layers": len(kv_caches),
        "block_shape": [int(d) for d in first.shape[1:]],
        "attention_backend": ",".join(backends),
        "cpu_isa": _cpu_isa(vllm_config),
        "tensor_parallel_size": int(parallel_config.tensor_parallel_size),
    }


def _cpu_isa(vllm_config: Any) -> str:
    """The CPU attention kernel's ISA (it decides how K and V are packed inside a block); 'none' off CPU."""
    if not current_platform.is_cpu():
        return "none"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: PLC0415 (CPU builds only)

    return str(
        _get_attn_isa(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.block_size,
            vllm_config.model_config.get_head_size(),
            vllm_config.cache_config.cache_dtype,
        )
    )
