"""KV cache sizes by layer type.

Per layer and token, with `b` bytes per element (2 for bf16/fp16, 1 for fp8):
- full attention (MHA/GQA): 2 (K and V) x num_key_value_heads x head_dim x b
- sliding-window attention: the same per token, but only the last `sliding_window` tokens are kept
- MLA: (kv_lora_rank + qk_rope_head_dim) x b, one compressed latent plus one shared RoPE key
- linear attention (Gated DeltaNet): nothing per token; a fixed state per request of
  num_value_heads x key_head_dim x value_head_dim (the recurrent state) plus
  (conv_kernel - 1) x conv_dim (the short-convolution state), stored at the same `b` bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdstack.plan.models import Attention, ModelSpec


@dataclass(frozen=True)
class KvFootprint:
    """The KV a model keeps, split by how it grows with the sequence."""

    bytes_per_element: int
    full_per_token: int  # bytes per token across all full-attention layers
    mla_per_token: int  # bytes per token across all MLA layers
    sliding_per_token: int  # bytes per token across all sliding-window layers, up to the window
    sliding_window: int | None
    linear_state_per_request: int  # bytes per request across all linear-attention layers, whatever its length

    @property
    def growing_per_token(self) -> int:
        """Bytes every token adds, however long the sequence (full attention and MLA)."""
        return self.full_per_token + self.mla_per_token

    def bytes_for(self, tokens: int) -> int:
        """Total KV bytes a sequence of `tokens` tokens holds."""
        if tokens <= 0:
            return 0
        kept_by_window = min(tokens, self.sliding_window) if self.sliding_window is not None else tokens
        return self.growing_per_token * tokens + self.sliding_per_token * kept_by_window + self.linear_state_per_request


def full_attention_bytes_per_token_per_layer(model: ModelSpec, bytes_per_element: int) -> int:
    return 2 * model.num_kv_heads * model.head_dim * bytes_per_element


def mla_bytes_per_token_per_layer(model: ModelSpec, bytes_per_element: int) -> int:
    assert model.mla is not None
    return (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * bytes_per_element


def linear_state_bytes_per_layer(model: ModelSpec, bytes_per_element: int) -> int:
    assert model.linear is not None
    lin = model.linear
    recurrent = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim
    conv = (lin.conv_kernel - 1) * lin.conv_dim
    return (recurrent + conv) * bytes_per_element


def kv_footprint(model: ModelSpec, bytes_per_element: int = 2) -> KvFootprint:
    per_layer_full = full_attention_bytes_per_token_per_layer(model, bytes_per_element)
    return KvFootprint(
        bytes_per_element=bytes_per_element,
        full_per_token=model.count(Attention.FULL) * per_layer_full,
        mla_per_token=model.count(Attention.MLA) * mla_bytes_per_token_per_layer(model, bytes_per_element)
        if model.mla is not None
        else 0,
        sliding_per_token=model.count(Attention.SLIDING) * per_layer_full,
        sliding_window=model.sliding_window,
        linear_state_per_request=model.count(Attention.LINEAR) * linear_state_bytes_per_layer(model, bytes_per_element)
        if model.linear is not None
        else 0,
    )
