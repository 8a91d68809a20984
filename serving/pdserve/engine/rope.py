"""Rotary position embeddings: inverse frequencies for each supported scaling type, and their application.

The formulas follow transformers' ``modeling_rope_utils`` so that logits match to float32 rounding.
Layout is the "rotate half" one every Llama-family HF checkpoint uses: the pair for frequency i is
(x[i], x[i + head_dim/2]).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from .config import RopeConfig

F32 = npt.NDArray[np.float32]


def _base_inv_freq(theta: float, dim: int) -> npt.NDArray[np.float64]:
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return 1.0 / (theta ** exponents.astype(np.float64))


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[F32, float]:
    """Return (inv_freq [head_dim/2], attention_scaling) for the rope type."""
    inv = _base_inv_freq(rope.theta, head_dim)
    scaling = 1.0
    if rope.rope_type == "default":
        pass
    elif rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv, scaling = _yarn(rope, head_dim)
    else:  # pragma: no cover - config.py rejects other types first
        raise ValueError(rope.rope_type)
    return inv.astype(np.float32), float(scaling)


def _yarn(rope: RopeConfig, dim: int) -> tuple[npt.NDArray[np.float64], float]:
    base, factor = rope.theta, rope.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float64)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, attention_factor


class Rotary:
    """Precomputed RoPE for one model: ``cos_sin(positions)`` and ``apply(x, cos, sin)``."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self.head_dim = head_dim
        self.inv_freq, self.attention_scaling = inverse_frequencies(rope, head_dim)

    def cos_sin(self, positions: npt.NDArray[np.int64]) -> tuple[F32, F32]:
        """cos/sin of shape [n, head_dim/2] for absolute positions [n] (attention scaling included)."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        cos = np.cos(freqs)
        sin = np.sin(freqs)
        if self.attention_scaling != 1.0:
            cos = cos * np.float32(self.attention_scaling)
            sin = sin * np.float32(self.attention_scaling)
        return cos.astype(np.float32, copy=False), sin.astype(np.float32, copy=False)

    @staticmethod
    def apply(x: F32, cos: F32, sin: F32) -> F32:
        """Rotate x [n, heads, head_dim] with cos/sin [n, head_dim/2]."""
        half = x.shape[-1] // 2
        x1 = x[..., :half]
        x2 = x[..., half:]
        c = cos[:, None, :]
        s = sin[:, None, :]
        out = np.empty_like(x)
        out[..., :half] = x1 * c - x2 * s
        out[..., half:] = x2 * c + x1 * s
        return out
