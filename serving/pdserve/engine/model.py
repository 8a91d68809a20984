"""The decoder forward pass, in float32 numpy.

One step processes a batch of sequences, each contributing any number of new tokens (a prefill chunk or one
decode token). All new tokens of the batch are concatenated into one row matrix so every dense projection and MLP
is a single matmul for the whole batch; only attention loops over sequences, each against its own KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from .config import ModelConfig
from .kv_cache import KVCache
from .rope import Rotary
from .weights import DenseMlpWeights, LayerWeights, ModelWeights, MoeMlpWeights

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@dataclass
class StepItem:
    """One sequence's share of a forward step: its new token ids and its cache (appended to in place)."""

    token_ids: I64
    cache: KVCache


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return cast(F32, (x * (1.0 / np.sqrt(variance + np.float32(eps)))).astype(np.float32, copy=False) * weight)


def silu(x: F32) -> F32:
    with np.errstate(over="ignore"):
        return cast(F32, x / (np.float32(1.0) + np.exp(-x)))


def softmax(x: F32, axis: int = -1) -> F32:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return cast(F32, e / np.sum(e, axis=axis, keepdims=True))


class Transformer:
    """Llama-family decoder (GQA attention, RoPE, RMSNorm, SwiGLU or Mixtral MoE MLP)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights) -> None:
        self.cfg = cfg
        self.weights = weights
        self.rotary = Rotary(cfg.rope, cfg.head_dim)
        self.scale = np.float32(cfg.head_dim**-0.5)

    def forward(self, items: Sequence[StepItem], all_logits: bool = False) -> list[F32]:
        """Run one step. Returns per item the logits of its last new token ``[vocab]``, or of every new token
        ``[t, vocab]`` with ``all_logits``. Appends each item's new K/V to its cache and advances its position."""
        cfg, w = self.cfg, self.weights
        lengths = [len(item.token_ids) for item in items]
        starts = np.cumsum([0, *lengths])
        ids = np.concatenate([item.token_ids for item in items]).astype(np.int64, copy=False)
        positions = np.concatenate(
            [
                np.arange(item.cache.position, item.cache.position + n, dtype=np.int64)
                for item, n in zip(items, lengths, strict=True)
            ]
        )
        cos, sin = self.rotary.cos_sin(positions)
        x = w.embed[ids]
        n_rows = x.shape[0]
        q_out = cfg.num_heads * cfg.head_dim
        kv_out = cfg.num_kv_heads * cfg.head_dim

        for layer_index, lw in enumerate(w.layers):
            h = rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
            qkv = h @ lw.qkv
            if lw.qkv_bias is not None:
                qkv += lw.qkv_bias
            q = Rotary.apply(qkv[:, :q_out].reshape(n_rows, cfg.num_heads, cfg.head_dim), cos, sin)
            k = Rotary.apply(qkv[:, q_out : q_out + kv_out].reshape(n_rows, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = qkv[:, q_out + kv_out :].reshape(n_rows, cfg.num_kv_heads, cfg.head_dim)
            attn = np.empty((n_rows, q_out), dtype=np.float32)
            for i, item in enumerate(items):
                s, e = int(starts[i]), int(starts[i + 1])
                attn[s:e] = self._attend(layer_index, item.cache, (q[s:e], k[s:e], v[s:e]), positions[s:e])
            out = attn @ lw.o
            if lw.o_bias is not None:
                out += lw.o_bias
            x = x + out
            h = rms_norm(x, lw.post_attention_norm, cfg.rms_norm_eps)
            x = x + self._mlp(lw, h)

        for item, n in zip(items, lengths, strict=True):
            item.cache.advance(n)

        rows = np.arange(n_rows) if all_logits else starts[1:] - 1
        logits = rms_norm(x[rows], w.final_norm, cfg.rms_norm_eps) @ w.lm_head
        if all_logits:
            return [logits[int(starts[i]) : int(starts[i + 1])] for i in range(len(items))]
        return [logits[i] for i in range(len(items))]

    def _attend(self, layer: int, cache: KVCache, qkv: tuple[F32, F32, F32], qpos: I64) -> F32:
        """Causal (optionally sliding-window) GQA attention of t new queries against the cache; returns [t, heads*d]."""
        cfg = self.cfg
        q, k, v = qkv
        t = q.shape[0]
        keys, values, first = cache.append(layer, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        window = cfg.layer_windows[layer]
        # Drop keys no new query can see (older than the first query's window).
        if window is not None:
            lowest = int(qpos[0]) - window + 1
            if lowest > first:
                keys = keys[:, lowest - first :]
                values = values[:, lowest - first :]
                first = lowest
        n_keys = keys.shape[1]
        groups = cfg.num_kv_groups
        # q: [t, heads, d] -> [kv_heads, groups * t, d] (head = kv_head * groups + g, as transformers' repeat_kv)
        qh = (
            q.reshape(t, cfg.num_kv_heads, groups, cfg.head_dim)
            .transpose(1, 2, 0, 3)
            .reshape(cfg.num_kv_heads, groups * t, cfg.head_dim)
        )
        scores = (qh @ keys.transpose(0, 2, 1)) * self.scale  # [kv_heads, groups * t, n_keys]
        if t > 1 or window is not None:
            kpos = first + np.arange(n_keys, dtype=np.int64)
            allowed = kpos[None, :] <= qpos[:, None]
            if window is not None:
                allowed &= kpos[None, :] > qpos[:, None] - window
            if not allowed.all():
                scores = scores.reshape(cfg.num_kv_heads, groups, t, n_keys)
                scores = np.where(allowed, scores, np.float32(-np.inf))
                scores = scores.reshape(cfg.num_kv_heads, groups * t, n_keys)
        probs = softmax(scores)
        out = probs @ values  # [kv_heads, groups * t, d]
        out = out.reshape(cfg.num_kv_heads, groups, t, cfg.head_dim).transpose(2, 0, 1, 3)
        return out.reshape(t, cfg.num_heads * cfg.head_dim)

    def _mlp(self, lw: LayerWeights, h: F32) -> F32:
        mlp = lw.mlp
        if isinstance(mlp, DenseMlpWeights):
            return self._dense_mlp(mlp, h)
        return self._moe(mlp, h)

    def _dense_mlp(self, mlp: DenseMlpWeights, h: F32) -> F32:
        inter = self.cfg.intermediate_size
        gate_up = h @ mlp.gate_up
        if mlp.gate_up_bias is not None:
            gate_up += mlp.gate_up_bias
        out = (silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ mlp.down
        if mlp.down_bias is not None:
            out += mlp.down_bias
        return out

    def _moe(self, mlp: MoeMlpWeights, h: F32) -> F32:
        """Mixtral routing: softmax over all experts, keep the top-k, renormalise, weighted sum of expert SwiGLUs."""
        assert self.cfg.moe is not None
        top_k = self.cfg.moe.top_k
        inter = self.cfg.intermediate_size
        probs = softmax(h @ mlp.router)  # [rows, experts]
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # [rows, top_k]
        chosen_p = np.take_along_axis(probs, chosen, axis=-1)
        chosen_p = chosen_p / np.sum(chosen_p, axis=-1, keepdims=True)
        out = np.zeros_like(h)
        for expert in np.unique(chosen):
            rows, slot = np.nonzero(chosen == expert)
            gate_up = h[rows] @ mlp.gate_up[expert]
            y = (silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ mlp.down[expert]
            out[rows] += y * chosen_p[rows, slot][:, None]
        return out
