"""Model configuration: parse a Hugging Face ``config.json`` into the few numbers the engine needs.

Supported ``model_type`` values and how each one decides which layers use sliding-window attention
(this mirrors what transformers 5.x actually runs, not just what the config declares):

* ``llama``   -- every layer is full attention (LlamaModel ignores ``sliding_window`` / ``layer_types``).
                 ``attention_bias`` adds q/k/v/o biases, ``mlp_bias`` adds gate/up/down biases.
* ``mistral`` -- every layer slides over ``sliding_window`` tokens when it is set, none otherwise
                 (MistralModel ignores ``layer_types``; transformers warns and so do we, in the docs).
* ``mixtral`` -- as mistral, plus a sparse mixture-of-experts MLP with top-k routing.
* ``qwen2``   -- q/k/v projections have biases. ``sliding_window`` only counts when ``use_sliding_window``
                 is true; then each layer follows ``layer_types`` ("full_attention" / "sliding_attention"),
                 or, when ``layer_types`` is absent, layers ``>= max_window_layers`` slide.

RoPE variants (``rope_parameters`` in transformers 5 configs, ``rope_scaling`` + ``rope_theta`` in older ones):
``default``, ``linear``, ``llama3`` and ``yarn``. ``dynamic`` (NTK) is rejected on purpose: its frequencies
depend on the running sequence length, so keys cached at one length would not match keys recomputed at
another, which breaks shipping KV between servers. ``longrope`` and the rest are rejected as unimplemented.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import CheckpointError, UnsupportedModelError, UnsupportedRopeScalingError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Per-model defaults for optional config.json fields, copied from transformers' config classes.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4096,
        "num_key_value_heads": 8,
    },
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096 * 32,
        "rope_theta": 1000000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": None,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2": {
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
}

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, already normalised from either config.json spelling."""

    rope_type: str
    theta: float
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoeConfig:
    """Mixtral-style sparse MLP: ``num_experts`` SwiGLU experts, each token goes to ``top_k`` of them."""

    num_experts: int
    top_k: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs, in engine terms."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    layer_types: tuple[str, ...]
    # Per layer: the sliding window in tokens, or None for full attention.
    layer_windows: tuple[int | None, ...]
    moe: MoeConfig | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # The dtype config.json declares ("float32", "float16", "bfloat16"), informational only.
    declared_dtype: str | None

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def canonical_json(self) -> str:
        """A stable text form, used in the engine fingerprint."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise CheckpointError(f"config.json not found: {path}") from exc
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"config.json is not valid JSON: {path}: {exc}") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        defaults = _DEFAULTS[model_type]

        def get(key: str) -> Any:
            return raw[key] if key in raw else defaults.get(key)

        for key in _REQUIRED:
            if raw.get(key) is None:
                raise CheckpointError(f"config.json of model_type {model_type!r} lacks required field {key!r}")

        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {hidden_act!r} (only 'silu' / SwiGLU is implemented)")

        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads_raw = get("num_key_value_heads")
        num_kv_heads = int(num_kv_heads_raw) if num_kv_heads_raw is not None else num_heads
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        num_layers = int(raw["num_hidden_layers"])
        max_pos = int(get("max_position_embeddings"))

        layer_types = _layer_types(model_type, raw, defaults, num_layers)
        window = _sliding_window(model_type, raw, defaults)
        layer_windows = tuple(window if t == SLIDING_ATTENTION else None for t in layer_types)
        if window is None:
            layer_types = tuple(FULL_ATTENTION for _ in layer_types)

        moe: MoeConfig | None = None
        if model_type == "mixtral":
            moe = MoeConfig(num_experts=int(get("num_local_experts")), top_k=int(get("num_experts_per_tok")))
            if not 0 < moe.top_k <= moe.num_experts:
                raise UnsupportedModelError(
                    f"num_experts_per_tok={moe.top_k} must be in 1..num_local_experts={moe.num_experts}"
                )

        attention_bias = bool(raw.get("attention_bias", False)) if model_type == "llama" else False
        eos = get("eos_token_id")
        eos_ids: tuple[int, ...] = (
            () if eos is None else tuple(int(x) for x in (eos if isinstance(eos, list) else [eos]))
        )
        bos = get("bos_token_id")

        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if model_type == "llama" else False,
            rope=_rope_config(raw, defaults, max_pos, head_dim),
            layer_types=layer_types,
            layer_windows=layer_windows,
            moe=moe,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            declared_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _sliding_window(model_type: str, raw: dict[str, Any], defaults: dict[str, Any]) -> int | None:
    if model_type == "llama":
        return None
    window = raw.get("sliding_window", defaults.get("sliding_window"))
    if model_type == "qwen2" and not raw.get("use_sliding_window", defaults["use_sliding_window"]):
        return None
    if window is None:
        return None
    window = int(window)
    if window <= 0:
        raise UnsupportedModelError(f"sliding_window must be positive, got {window}")
    return window


def _layer_types(model_type: str, raw: dict[str, Any], defaults: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if model_type == "llama":
        return tuple(FULL_ATTENTION for _ in range(num_layers))
    if model_type in ("mistral", "mixtral"):
        # transformers applies config.sliding_window to every layer of these models, whatever layer_types says.
        return tuple(SLIDING_ATTENTION for _ in range(num_layers))
    # qwen2
    declared = raw.get("layer_types")
    if declared is None:
        max_window_layers = int(raw.get("max_window_layers", defaults["max_window_layers"]))
        return tuple(SLIDING_ATTENTION if i >= max_window_layers else FULL_ATTENTION for i in range(num_layers))
    if len(declared) != num_layers:
        raise UnsupportedModelError(f"layer_types has {len(declared)} entries but num_hidden_layers={num_layers}")
    for kind in declared:
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise UnsupportedModelError(
                f"unsupported layer type {kind!r} in layer_types (supported: {FULL_ATTENTION}, {SLIDING_ATTENTION})"
            )
    return tuple(str(k) for k in declared)


def _rope_config(raw: dict[str, Any], defaults: dict[str, Any], max_pos: int, head_dim: int) -> RopeConfig:
    params: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedRopeScalingError("per-layer-type rope_parameters are not supported")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    theta = float(params.get("rope_theta", raw.get("rope_theta", defaults["rope_theta"])))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedRopeScalingError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if head_dim % 2:
        raise UnsupportedModelError(f"head_dim={head_dim} must be even for RoPE")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeScalingError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )

    def need(key: str) -> Any:
        if params.get(key) is None:
            raise UnsupportedRopeScalingError(f"rope scaling type {rope_type!r} needs the field {key!r}")
        return params[key]

    original = int(
        params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or max_pos
    )
    if rope_type == "default":
        return RopeConfig(rope_type=rope_type, theta=theta)
    if rope_type == "linear":
        return RopeConfig(rope_type=rope_type, theta=theta, factor=float(need("factor")))
    if rope_type == "llama3":
        return RopeConfig(
            rope_type=rope_type,
            theta=theta,
            factor=float(need("factor")),
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
            original_max_position_embeddings=original,
        )
    # yarn
    factor = params.get("factor")
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(factor) if factor is not None else max_pos / original,
        original_max_position_embeddings=original,
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=None if params.get("mscale") is None else float(params["mscale"]),
        mscale_all_dim=None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"]),
        truncate=bool(params.get("truncate", True)),
    )
