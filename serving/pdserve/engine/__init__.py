"""Reference numpy inference engine for Llama-family Hugging Face checkpoints.

Files, one concern each:
  config.py       config.json -> ModelConfig (model types, sliding/full layers, RoPE variants, MoE)
  weights.py      *.safetensors -> float32 arrays (bf16 via raw bits), weights checksum
  rope.py         rotary embeddings (default, linear, llama3, yarn)
  kv_cache.py     per-sequence KV cache, its layout and (de)serialisation
  model.py        the batched forward step (GQA attention, RMSNorm, SwiGLU, Mixtral MoE)
  tokenizer.py    tokenizers-backed encode/decode and chat templates rendered like transformers
  detokenizer.py  incremental detokenisation for streaming
  sampling.py     sampling parameters, sampler, per-request stop handling
  engine.py       Engine: load, fingerprint, forward, prefill, generate
  testmodels.py   tiny seeded test checkpoints (numpy only)
"""

from .config import ModelConfig, MoeConfig, RopeConfig
from .detokenizer import IncrementalDetokenizer
from .engine import ENGINE_MAJOR_VERSION, Engine, GenerationResult, compute_fingerprint
from .errors import (
    CheckpointError,
    EngineError,
    KVCacheError,
    MissingTensorError,
    TensorShapeError,
    UnsupportedModelError,
    UnsupportedRopeScalingError,
)
from .kv_cache import KV_DTYPE_NAME, KV_LAYOUT_VERSION, KVCache, KVCacheSpec, SerializedLayer
from .sampling import RequestState, Sampler, SamplingParams, TokenOutput
from .tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "ENGINE_MAJOR_VERSION",
    "KV_DTYPE_NAME",
    "KV_LAYOUT_VERSION",
    "ChatTemplateError",
    "CheckpointError",
    "Engine",
    "EngineError",
    "GenerationResult",
    "IncrementalDetokenizer",
    "KVCache",
    "KVCacheError",
    "KVCacheSpec",
    "MissingTensorError",
    "ModelConfig",
    "MoeConfig",
    "RequestState",
    "RopeConfig",
    "Sampler",
    "SamplingParams",
    "SerializedLayer",
    "TensorShapeError",
    "TokenOutput",
    "Tokenizer",
    "UnsupportedModelError",
    "UnsupportedRopeScalingError",
    "compute_fingerprint",
]
