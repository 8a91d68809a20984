"""Model shapes the planner works from: built-in entries (data/models.yaml) and Hugging Face config.json files.

Both go through `parse_config`, which reads the published config keys of each supported `model_type` and turns
them into a `ModelSpec`: one `Layer` per decoder layer (its attention kind and its MLP), plus the shapes the KV
and FLOP formulas need.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml


class ModelError(ValueError):
    """A model that cannot be read: unknown name, unreadable file, unsupported type or a missing config key."""


class Attention(StrEnum):
    FULL = "full"  # multi-head / grouped-query attention over every earlier token
    SLIDING = "sliding"  # attention over the last `sliding_window` tokens only
    MLA = "mla"  # multi-head latent attention: one compressed latent plus a RoPE key per token
    LINEAR = "linear"  # linear attention (Gated DeltaNet): a fixed-size state per request, nothing per token


@dataclass(frozen=True)
class Layer:
    attention: Attention
    moe: bool  # False: a dense MLP of `intermediate_size`


@dataclass(frozen=True)
class MlaShape:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class LinearShape:
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int  # all shared experts together; 0 when there are none


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    model_type: str
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    layers: tuple[Layer, ...]
    sliding_window: int | None = None
    mla: MlaShape | None = None
    linear: LinearShape | None = None
    moe: MoeShape | None = None
    attention_output_gate: bool = False  # Qwen3-Next's full-attention layers gate their output (doubles q_proj)
    max_position_embeddings: int | None = None  # the longest context the checkpoint is made for
    fp8_weights: bool = False  # the checkpoint stores its linear weights in FP8 (quantization_config quant_method)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def count(self, attention: Attention) -> int:
        return sum(1 for layer in self.layers if layer.attention is attention)

    def layer_mix(self) -> dict[str, int]:
        return {kind.value: self.count(kind) for kind in Attention if self.count(kind)}


# ---------------------------------------------------------------------------------------------- config parsing


class _Config:
    """Typed access to a config.json mapping, with errors naming the missing or malformed key."""

    def __init__(self, raw: dict[str, Any], where: str) -> None:
        self.raw = raw
        self.where = where
        self.model_type = str(raw.get("model_type"))

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key, default)
        if value is None:
            raise ModelError(f"{self.where}: model_type {self.model_type!r} needs key {key!r}, which is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelError(f"{self.where}: key {key!r} must be a non-negative integer, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        return None if self.raw.get(key) is None else self.integer(key)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise ModelError(f"{self.where}: key {key!r} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise ModelError(f"{self.where}: key {key!r} must be a list of layer indices, got {value!r}")
        return value


DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
MOE_GQA_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe"}
MLA_TYPES = {"deepseek_v3", "deepseek_v2"}
HYBRID_LINEAR_TYPES = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
SUPPORTED_TYPES = sorted(DENSE_TYPES | MOE_GQA_TYPES | MLA_TYPES | HYBRID_LINEAR_TYPES)


def parse_config(raw: dict[str, Any], name: str, source: str) -> ModelSpec:
    """Turn a Hugging Face config.json mapping into a ModelSpec, or raise ModelError naming the offending key."""
    if isinstance(raw.get("text_config"), dict):  # multimodal wrappers (Qwen3.5) keep the decoder under text_config
        raw = raw["text_config"]
    cfg = _Config(raw, source)
    if "model_type" not in raw:
        raise ModelError(f"{source}: key 'model_type' is missing (supported: {', '.join(SUPPORTED_TYPES)})")
    if cfg.model_type not in SUPPORTED_TYPES:
        raise ModelError(
            f"{source}: model_type {cfg.model_type!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    heads = cfg.integer("num_attention_heads")
    hidden = cfg.integer("hidden_size")
    num_layers = cfg.integer("num_hidden_layers")
    common: dict[str, Any] = {
        "name": name,
        "source": source,
        "model_type": cfg.model_type,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": cfg.integer("num_key_value_heads", heads),
        "head_dim": cfg.optional_int("head_dim") or hidden // heads,
        "vocab_size": cfg.integer("vocab_size"),
        "intermediate_size": cfg.integer("intermediate_size", 0 if cfg.model_type in HYBRID_LINEAR_TYPES else None),
        "tie_word_embeddings": cfg.flag("tie_word_embeddings", False),
        "max_position_embeddings": cfg.optional_int("max_position_embeddings"),
        "fp8_weights": _fp8_weights(raw),
    }
    if cfg.model_type in MLA_TYPES:
        return _mla_model(cfg, num_layers, common)
    if cfg.model_type in HYBRID_LINEAR_TYPES:
        return _hybrid_linear_model(cfg, num_layers, common)
    return _gqa_model(cfg, num_layers, common)


def _fp8_weights(raw: dict[str, Any]) -> bool:
    quant = raw.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "fp8"


def _gqa_model(cfg: _Config, num_layers: int, common: dict[str, Any]) -> ModelSpec:
    window = _sliding_window(cfg)
    kinds = _layer_types(cfg, num_layers) or [
        Attention.SLIDING if window is not None and i >= cfg.integer("max_window_layers", 0) else Attention.FULL
        for i in range(num_layers)
    ]
    moe = _gqa_moe(cfg)
    sparse = _sparse_layers(cfg, num_layers) if moe is not None else set()
    layers = tuple(Layer(kind, i in sparse) for i, kind in enumerate(kinds))
    if any(layer.attention is Attention.SLIDING for layer in layers) and window is None:
        raise ModelError(f"{cfg.where}: layer_types has sliding layers but key 'sliding_window' is missing")
    return ModelSpec(**common, layers=layers, sliding_window=window, moe=moe)


def _sliding_window(cfg: _Config) -> int | None:
    if cfg.model_type in {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"} and not cfg.flag("use_sliding_window", False):
        return None
    return cfg.optional_int("sliding_window")


def _layer_types(cfg: _Config, num_layers: int) -> list[Attention] | None:
    names = cfg.raw.get("layer_types")
    if names is None:
        return None
    mapping = {
        "full_attention": Attention.FULL,
        "sliding_attention": Attention.SLIDING,
        "linear_attention": Attention.LINEAR,
    }
    if not isinstance(names, list) or len(names) != num_layers or any(n not in mapping for n in names):
        raise ModelError(
            f"{cfg.where}: key 'layer_types' must list one of {sorted(mapping)} for each of the {num_layers} layers"
        )
    return [mapping[n] for n in names]


def _gqa_moe(cfg: _Config) -> MoeShape | None:
    if cfg.model_type == "mixtral":
        return MoeShape(
            cfg.integer("num_local_experts"), cfg.integer("num_experts_per_tok"), cfg.integer("intermediate_size"), 0
        )
    if cfg.model_type in {"qwen2_moe", "qwen3_moe"}:
        return MoeShape(
            cfg.integer("num_experts"),
            cfg.integer("num_experts_per_tok"),
            cfg.integer("moe_intermediate_size"),
            cfg.integer("shared_expert_intermediate_size", 0),
        )
    return None


def _sparse_layers(cfg: _Config, num_layers: int) -> set[int]:
    """Qwen MoE convention: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and not in mlp_only_layers."""
    step = cfg.integer("decoder_sparse_step", 1)
    dense_only = set(cfg.int_list("mlp_only_layers"))
    return {i for i in range(num_layers) if i not in dense_only and step > 0 and (i + 1) % step == 0}


def _mla_model(cfg: _Config, num_layers: int, common: dict[str, Any]) -> ModelSpec:
    mla = MlaShape(
        q_lora_rank=cfg.optional_int("q_lora_rank"),
        kv_lora_rank=cfg.integer("kv_lora_rank"),
        qk_nope_head_dim=cfg.integer("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.integer("qk_rope_head_dim"),
        v_head_dim=cfg.integer("v_head_dim"),
    )
    moe_experts = cfg.integer("n_routed_experts", 0)
    moe = None
    if moe_experts:
        moe = MoeShape(
            num_experts=moe_experts,
            experts_per_token=cfg.integer("num_experts_per_tok"),
            expert_intermediate_size=cfg.integer("moe_intermediate_size"),
            shared_intermediate_size=cfg.integer("n_shared_experts", 0) * cfg.integer("moe_intermediate_size"),
        )
    first_dense = cfg.integer("first_k_dense_replace", 0)
    freq = cfg.integer("moe_layer_freq", 1)
    layers = tuple(
        Layer(Attention.MLA, moe is not None and i >= first_dense and freq > 0 and i % freq == 0)
        for i in range(num_layers)
    )
    return ModelSpec(**common, layers=layers, mla=mla, moe=moe)


def _hybrid_linear_model(cfg: _Config, num_layers: int, common: dict[str, Any]) -> ModelSpec:
    interval = cfg.integer("full_attention_interval", 4)
    kinds = _layer_types(cfg, num_layers) or [
        Attention.FULL if (i + 1) % interval == 0 else Attention.LINEAR for i in range(num_layers)
    ]
    linear = LinearShape(
        num_key_heads=cfg.integer("linear_num_key_heads"),
        num_value_heads=cfg.integer("linear_num_value_heads"),
        key_head_dim=cfg.integer("linear_key_head_dim"),
        value_head_dim=cfg.integer("linear_value_head_dim"),
        conv_kernel=cfg.integer("linear_conv_kernel_dim"),
    )
    moe = None
    if cfg.integer("num_experts", 0):
        moe = MoeShape(
            cfg.integer("num_experts"),
            cfg.integer("num_experts_per_tok"),
            cfg.integer("moe_intermediate_size"),
            cfg.integer("shared_expert_intermediate_size", 0),
        )
    sparse = _sparse_layers(cfg, num_layers) if moe is not None else set()
    layers = tuple(Layer(kind, i in sparse) for i, kind in enumerate(kinds))
    return ModelSpec(**common, layers=layers, linear=linear, moe=moe, attention_output_gate=True)


# ---------------------------------------------------------------------------------------------- lookup


@dataclass(frozen=True)
class BuiltinEntry:
    name: str
    source: str
    aliases: tuple[str, ...]
    config: dict[str, Any]


@cache
def builtin_entries() -> dict[str, BuiltinEntry]:
    text = files("pdstack").joinpath("data/models.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)["models"]
    return {
        name: BuiltinEntry(name, entry["source"], tuple(entry.get("aliases", [])), entry["config"])
        for name, entry in raw.items()
    }


def builtin_model(name: str) -> ModelSpec:
    entry = builtin_entries()[name]
    return parse_config(entry.config, entry.name, entry.source)


_SUFFIXES = re.compile(r"(-(instruct|chat|base|hf|it|fp8))+$")


def normalise_model_name(name: str) -> str:
    """`meta-llama/Llama-3.1-70B-Instruct` -> `llama-3.1-70b`: the form served names are matched in."""
    base = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-").replace(" ", "-")
    return _SUFFIXES.sub("", base)


def match_builtin(served_name: str) -> str | None:
    """The built-in entry a served model name stands for, or None when it matches no name or alias."""
    wanted = normalise_model_name(served_name)
    for entry in builtin_entries().values():
        if wanted in {normalise_model_name(entry.name), *(normalise_model_name(a) for a in entry.aliases)}:
            return entry.name
    return None


def load_config_file(path: Path) -> ModelSpec:
    """A Hugging Face config.json (or the checkpoint folder holding one)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"{file}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{file}: not valid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{file}: a config.json must be a JSON object")
    return parse_config(raw, raw.get("_name_or_path") or file.parent.name or file.name, str(file))


def resolve_model(model: str) -> ModelSpec:
    """A built-in name or alias, else a path to a config.json or a checkpoint folder."""
    builtin = match_builtin(model)
    if builtin is not None:
        return builtin_model(builtin)
    path = Path(model)
    if path.exists():
        return load_config_file(path)
    known = ", ".join(builtin_entries())
    raise ModelError(f"model {model!r} is neither a built-in ({known}) nor an existing config.json path")
