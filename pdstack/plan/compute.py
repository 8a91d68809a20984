"""Parameter counts and FLOPs of a model, from its layer shapes.

Weights are counted from the projection shapes (norms and biases are left out: under 0.1 % of any model here).
A forward pass costs 2 FLOPs per weight a token touches, plus attention's own work:
- full/MLA attention, causal: per layer 2 x heads x (qk_dim + v_dim) x sum over queries of the keys each one sees,
  which is n(n+1)/2 for a prompt of n tokens (the quadratic term), and up to `sliding_window` keys per query
  for sliding layers;
- linear attention (chunked delta rule): about 4 x value_heads x key_dim x value_dim per token and layer
  (one state update and one state read per token), linear in n.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdstack.plan.models import Attention, Layer, ModelSpec


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every weight, embeddings included
    always_active: int  # weights every token touches in a forward pass: attention, dense MLPs, shared experts, head
    expert: int  # one routed expert's weights (gate, up, down)
    moe_layers: int
    experts_per_token: int
    num_experts: int
    embedding: int  # the input embedding table (a lookup, not a matmul: no FLOPs, no streaming per step)

    @property
    def active_per_token(self) -> int:
        """Weights one token multiplies through (MoE: its top-k routed experts plus everything always active)."""
        return self.always_active + self.moe_layers * self.experts_per_token * self.expert

    def touched_by_batch(self, batch: int) -> float:
        """Expected weights a decode step over `batch` sequences reads: distinct experts hit per MoE layer is
        E x (1 - (1 - k/E)^batch) under uniform routing."""
        if self.num_experts == 0:
            return float(self.always_active)
        hit = self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** batch)
        return self.always_active + self.moe_layers * hit * self.expert


def attention_params(model: ModelSpec, layer: Layer) -> int:
    h = model.hidden_size
    if layer.attention is Attention.MLA:
        assert model.mla is not None
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        heads = model.num_attention_heads
        q = h * heads * qk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * heads * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h
    if layer.attention is Attention.LINEAR:
        assert model.linear is not None
        lin = model.linear
        value_dim = lin.num_value_heads * lin.value_head_dim
        in_proj = h * (2 * lin.num_key_heads * lin.key_head_dim + 2 * value_dim) + h * 2 * lin.num_value_heads
        return in_proj + lin.conv_dim * lin.conv_kernel + value_dim * h
    q_width = model.num_attention_heads * model.head_dim
    q = h * q_width * (2 if model.attention_output_gate else 1)
    kv = 2 * h * model.num_kv_heads * model.head_dim
    return q + kv + q_width * h


def param_counts(model: ModelSpec) -> ParamCounts:
    h = model.hidden_size
    embedding = model.vocab_size * h
    head = 0 if model.tie_word_embeddings else model.vocab_size * h
    always = head
    total = embedding + head
    moe_layers = 0
    moe = model.moe
    expert = 3 * h * moe.expert_intermediate_size if moe is not None else 0
    for layer in model.layers:
        attn = attention_params(model, layer)
        always += attn
        total += attn
        if layer.moe and moe is not None:
            shared = 3 * h * moe.shared_intermediate_size
            router = h * moe.num_experts
            always += shared + router
            total += shared + router + moe.num_experts * expert
            moe_layers += 1
        else:
            always += 3 * h * model.intermediate_size
            total += 3 * h * model.intermediate_size
    return ParamCounts(
        total=total,
        always_active=always,
        expert=expert,
        moe_layers=moe_layers,
        experts_per_token=moe.experts_per_token if moe is not None else 0,
        num_experts=moe.num_experts if moe is not None else 0,
        embedding=embedding,
    )


def attended_pairs(tokens: int, window: int | None) -> int:
    """Query-key pairs of causal attention over `tokens` tokens, each query seeing at most `window` keys."""
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def attention_flops(model: ModelSpec, tokens: int, context_before: int = 0) -> float:
    """FLOPs of attention itself (not its projections) for `tokens` new tokens after `context_before` cached ones."""
    flops = 0.0
    for kind in (Attention.FULL, Attention.SLIDING, Attention.MLA):
        layers = model.count(kind)
        if not layers:
            continue
        window = model.sliding_window if kind is Attention.SLIDING else None
        pairs = attended_pairs(context_before + tokens, window) - attended_pairs(context_before, window)
        if kind is Attention.MLA:
            assert model.mla is not None
            dims = model.mla.qk_nope_head_dim + model.mla.qk_rope_head_dim + model.mla.v_head_dim
        else:
            dims = 2 * model.head_dim
        flops += layers * 2 * model.num_attention_heads * dims * pairs
    if model.linear is not None:
        lin = model.linear
        per_token = 4 * lin.num_value_heads * lin.key_head_dim * lin.value_head_dim
        flops += model.count(Attention.LINEAR) * per_token * tokens
    return flops


def prefill_flops(model: ModelSpec, prompt_tokens: int, counts: ParamCounts | None = None) -> float:
    """FLOPs to prefill one prompt: 2 per active weight per token, attention's quadratic term, one logits row."""
    counts = counts or param_counts(model)
    head = model.vocab_size * model.hidden_size
    matmuls = 2.0 * (counts.active_per_token - (0 if model.tie_word_embeddings else head)) * prompt_tokens
    return matmuls + attention_flops(model, prompt_tokens) + 2.0 * head
