"""The serving engine: pdserve's reference engine or vLLM, and for vLLM the release both sides run (its image pinned
by digest, the settings the KV fingerprint covers, the connector, each side's parallelism) and the extra vLLM flags a
stack may pass through."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdstack.model.base import Strict
from pdstack.model.topology import PoolRole


class Engine(StrEnum):
    PDSERVE = "pdserve"  # pdserve's numpy reference engine
    VLLM = "vllm"


class KvConnector(StrEnum):
    PDSTACK = "pdstack"  # pdserve.vllm.connector.PdstackConnector over the KV channel: across datacenters
    NIXL = "nixl"  # vLLM's NixlConnector over RDMA: both ends in one region, with EFA


# The resolved compute dtype. vLLM's `auto` is refused: it resolves per platform (vLLM-cpu turns an fp32
# checkpoint into bf16), and the KV fingerprint must be the same on both ends.
VllmDtype = Literal["bfloat16", "float16", "float32"]

IMAGE_BY_DIGEST = re.compile(
    r"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?@sha256:[0-9a-f]{64}$"
)
VERSION_IN_TAG = re.compile(r"^v?(\d+\.\d+\.\d+)")

EXTRA_FLAGS: dict[str, type] = {
    "enable-prefix-caching": bool,
    "enable-chunked-prefill": bool,
    "async-scheduling": bool,
    "enforce-eager": bool,
    "max-num-seqs": int,
    "max-num-batched-tokens": int,
    "long-prefill-token-threshold": int,
    "seed": int,
    "all2all-backend": str,
}
"""vLLM 0.32 flags a stack may pass through (`serving.vllm.extra_args`), by name without the leading `--`, with
the type of their value. Each is a tuning knob that changes neither the KV layout nor what pdstack sets itself."""

OWNED_FLAGS: dict[str, str] = {
    "model": "serving.model.path",
    "served-model-name": "serving.model.name",
    "revision": "serving.model.revision",
    "host": "the contract",
    "port": "serving.ports",
    "api-key": "the server-api-token secret",
    "dtype": "serving.vllm.dtype",
    "kv-cache-dtype": "serving.vllm.kv_cache_dtype",
    "max-model-len": "serving.vllm.max_model_len",
    "block-size": "serving.vllm.block_size",
    "gpu-memory-utilization": "serving.vllm.gpu_memory_utilization",
    "tensor-parallel-size": "serving.vllm.<prefill|decode>.tensor_parallel_size",
    "data-parallel-size": "serving.vllm.<prefill|decode>.data_parallel_size",
    "enable-expert-parallel": "serving.vllm.<prefill|decode>.enable_expert_parallel",
    "enable-eplb": "serving.vllm.<prefill|decode>.enable_eplb",
    "eplb-config": "serving.vllm.<prefill|decode>.num_redundant_experts",
    "kv-transfer-config": "serving.vllm.kv_connector",
    "otlp-traces-endpoint": "serving.tracing.otlp_endpoint",
}
"""Flags pdstack derives from typed settings: passing one as an extra flag would fork the truth."""

ALL2ALL_BACKENDS = (
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "flashinfer_all2allv",
    "naive",
    "pplx",
)

ExtraValue = bool | int | str


class VllmRole(Strict):
    """One side's engine shape: parallelism, and (rarely) an override of the shared dtype, block size or memory
    share. What the KV fingerprint covers (dtype, block size) must still agree between the sides."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=72, description="GPUs one layer is split across")
    data_parallel_size: int = Field(default=1, ge=1, le=1024, description="engine replicas, one per TP group")
    enable_expert_parallel: bool = Field(default=False, description="MoE experts split across TP x DP GPUs")
    enable_eplb: bool = Field(default=False, description="vLLM's expert-parallel load balancer")
    num_redundant_experts: int = Field(default=0, ge=0, le=1024, description="extra expert copies EPLB places")
    dtype: VllmDtype | None = None
    block_size: int | None = Field(default=None, ge=1, le=1024)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


class Vllm(Strict):
    """The vLLM release both sides run: the image and version, the settings the KV fingerprint covers, the
    connector, and each side's parallelism."""

    image: str = Field(min_length=1, description="image reference pinned by digest: name[:tag]@sha256:<64 hex>")
    version: str = Field(pattern=r"^\d+\.\d+\.\d+$", description="the vLLM version the image holds")
    dtype: VllmDtype = "bfloat16"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    max_model_len: int = Field(ge=1, le=10_000_000)
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV cache block")
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1, description="vLLM's default is 0.92")
    kv_connector: KvConnector = KvConnector.PDSTACK
    extra_args: dict[str, ExtraValue] = Field(default_factory=dict)
    prefill: VllmRole = VllmRole()
    decode: VllmRole = VllmRole()

    @field_validator("image")
    @classmethod
    def _pinned_by_digest(cls, image: str) -> str:
        if "@" not in image:
            raise ValueError(f"{image!r} is not pinned: add @sha256:<digest> (a tag alone can move)")
        if not IMAGE_BY_DIGEST.match(image):
            raise ValueError(f"{image!r} is not an image reference of the form name[:tag]@sha256:<64 lower-case hex>")
        return image

    @field_validator("extra_args")
    @classmethod
    def _allowed_flags(cls, args: dict[str, ExtraValue]) -> dict[str, ExtraValue]:
        for flag, value in args.items():
            _check_extra_flag(flag, value)
        return args

    @model_validator(mode="after")
    def _tag_matches_version(self) -> Vllm:
        match = IMAGE_BY_DIGEST.match(self.image)
        tag = match.group("tag") if match else None
        named = VERSION_IN_TAG.match(tag) if tag else None
        if named and named.group(1) != self.version:
            raise ValueError(
                f"serving.vllm.image is tagged {tag!r} but serving.vllm.version is {self.version!r}: "
                "the release records the version, so they must agree"
            )
        return self

    def role(self, role: PoolRole) -> VllmRole:
        return self.prefill if role is PoolRole.PREFILL else self.decode

    def setting(self, role: PoolRole, name: str) -> tuple[Any, str]:
        """A role's effective value of a shared setting, and the field path it comes from."""
        override = getattr(self.role(role), name)
        if override is not None:
            return override, f"serving.vllm.{role}.{name}"
        return getattr(self, name), f"serving.vllm.{name}"


def _check_extra_flag(flag: str, value: ExtraValue) -> None:
    at = f"serving.vllm.extra_args.{flag}"
    if flag.startswith("-"):
        raise ValueError(f"{at}: write the flag without its leading dashes, as {flag.lstrip('-')!r}")
    if flag in OWNED_FLAGS:
        raise ValueError(f"{at}: pdstack sets --{flag} itself, from {OWNED_FLAGS[flag]}")
    kind = EXTRA_FLAGS.get(flag)
    if kind is None:
        raise ValueError(f"{at}: --{flag} is not an allowed extra vLLM flag (allowed: {', '.join(EXTRA_FLAGS)})")
    if type(value) is not kind:
        raise ValueError(f"{at}: --{flag} takes a {kind.__name__} value, got {type(value).__name__} {value!r}")
    if kind is int and isinstance(value, int) and value < (0 if flag == "seed" else 1):
        raise ValueError(f"{at}: --{flag} must be {'non-negative' if flag == 'seed' else 'at least 1'}, got {value}")
    if flag == "all2all-backend" and value not in ALL2ALL_BACKENDS:
        raise ValueError(f"{at}: {value!r} is not one of {', '.join(ALL2ALL_BACKENDS)}")
