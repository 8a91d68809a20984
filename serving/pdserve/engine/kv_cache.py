"""Per-sequence KV cache.

Layout (KV layout version 1, part of the engine fingerprint):

* one (K, V) pair per decoder layer, each a float32 array of shape ``[num_kv_heads, tokens, head_dim]``,
  C-contiguous, little-endian; K is stored *after* RoPE, at the token's absolute position.
* ``position`` is the number of tokens the sequence has consumed (the absolute position of the next token).
* a full-attention layer holds all ``position`` tokens; a sliding layer with window W holds only the last
  ``min(position, W)`` tokens (absolute positions ``position - tokens .. position - 1``). That trimmed KV is what
  ``layers()`` returns and what gets shipped from prefill to decode.

float32 is used whatever the checkpoint's storage dtype: the engine computes in float32, and keeping the cache in
the compute dtype makes a shipped cache bit-identical to one computed locally.

Internally each layer is a growable buffer with spare capacity, so a decode step appends in amortised O(1);
sliding layers compact their buffer back to the window when it fills.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import KVCacheError

KV_LAYOUT_VERSION = 1
KV_DTYPE = np.dtype("<f4")
KV_DTYPE_NAME = "float32"

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of a model's KV cache: what two servers must agree on to exchange one."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]  # per layer: sliding window, or None for full attention

    def layer_tokens(self, layer: int, position: int) -> int:
        """How many tokens layer ``layer`` holds once the sequence has consumed ``position`` tokens."""
        window = self.layer_windows[layer]
        return position if window is None else min(position, window)


@dataclass(frozen=True)
class SerializedLayer:
    """One layer of a cache as bytes, the unit the KV channel ships."""

    dtype: str  # numpy dtype name, always "float32" in layout version 1
    shape: tuple[int, int, int]  # [num_kv_heads, tokens, head_dim], for K and V alike
    k: bytes
    v: bytes


class KVCache:
    """KV cache of one sequence; see the module docstring for the layout."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec
        self.position = 0
        empty = np.zeros((spec.num_kv_heads, 0, spec.head_dim), dtype=KV_DTYPE)
        self._k: list[F32] = [empty for _ in range(spec.num_layers)]
        self._v: list[F32] = [empty for _ in range(spec.num_layers)]
        self._len: list[int] = [0] * spec.num_layers  # tokens physically in each buffer (>= the logical count)

    # -- reading ---------------------------------------------------------------------------------------------------

    def layer_tokens(self, layer: int) -> int:
        return self.spec.layer_tokens(layer, self.position)

    def layer(self, layer: int) -> tuple[F32, F32]:
        """(K, V) of one layer, trimmed to the window for sliding layers. Read-only views into the buffers."""
        end = self._len[layer]
        start = end - self.layer_tokens(layer)
        k = self._k[layer][:, start:end]
        v = self._v[layer][:, start:end]
        k.flags.writeable = False
        v.flags.writeable = False
        return k, v

    def layers(self) -> list[tuple[F32, F32]]:
        """Every layer's (K, V), in layer order (views: valid until the cache is next appended to)."""
        return [self.layer(i) for i in range(self.spec.num_layers)]

    def nbytes(self) -> int:
        """Bytes of the logical (trimmed) KV, i.e. what shipping this cache costs."""
        per_token = 2 * self.spec.num_kv_heads * self.spec.head_dim * KV_DTYPE.itemsize
        return sum(self.layer_tokens(i) for i in range(self.spec.num_layers)) * per_token

    # -- serialisation ---------------------------------------------------------------------------------------------

    def serialize_layer(self, layer: int) -> SerializedLayer:
        k, v = self.layer(layer)
        shape = (int(k.shape[0]), int(k.shape[1]), int(k.shape[2]))
        return SerializedLayer(
            KV_DTYPE_NAME, shape, np.ascontiguousarray(k).tobytes(), np.ascontiguousarray(v).tobytes()
        )

    def serialize(self) -> list[SerializedLayer]:
        return [self.serialize_layer(i) for i in range(self.spec.num_layers)]

    @classmethod
    def from_layers(
        cls, spec: KVCacheSpec, layers: Sequence[tuple[npt.ArrayLike, npt.ArrayLike]], position: int
    ) -> KVCache:
        """Rebuild a cache from per-layer (K, V) arrays and the sequence's token count (the arrays are copied)."""
        if len(layers) != spec.num_layers:
            raise KVCacheError(f"got {len(layers)} KV layers, the model has {spec.num_layers}")
        if position < 0:
            raise KVCacheError(f"position must be >= 0, got {position}")
        cache = cls(spec)
        cache.position = position
        for i, (k, v) in enumerate(layers):
            expected = (spec.num_kv_heads, spec.layer_tokens(i, position), spec.head_dim)
            k_arr = np.asarray(k)
            v_arr = np.asarray(v)
            for name, arr in (("K", k_arr), ("V", v_arr)):
                if arr.shape != expected:
                    raise KVCacheError(f"layer {i} {name} has shape {list(arr.shape)}, expected {list(expected)}")
                if arr.dtype != KV_DTYPE:
                    raise KVCacheError(f"layer {i} {name} has dtype {arr.dtype}, expected {KV_DTYPE_NAME}")
            cache._k[i] = np.array(k_arr, dtype=KV_DTYPE, order="C")
            cache._v[i] = np.array(v_arr, dtype=KV_DTYPE, order="C")
            cache._len[i] = expected[1]
        return cache

    @classmethod
    def deserialize(cls, spec: KVCacheSpec, layers: Sequence[SerializedLayer], position: int) -> KVCache:
        arrays: list[tuple[F32, F32]] = []
        for i, layer in enumerate(layers):
            if layer.dtype != KV_DTYPE_NAME:
                raise KVCacheError(f"layer {i} has dtype {layer.dtype!r}, expected {KV_DTYPE_NAME!r}")
            count = int(np.prod(layer.shape))
            if len(layer.k) != count * KV_DTYPE.itemsize or len(layer.v) != count * KV_DTYPE.itemsize:
                raise KVCacheError(f"layer {i}: byte length does not match shape {list(layer.shape)}")
            k = np.frombuffer(layer.k, dtype=KV_DTYPE).reshape(layer.shape)
            v = np.frombuffer(layer.v, dtype=KV_DTYPE).reshape(layer.shape)
            arrays.append((k, v))
        return cls.from_layers(spec, arrays, position)

    def copy(self) -> KVCache:
        """An independent copy (e.g. to branch a sequence)."""
        return KVCache.from_layers(self.spec, [(np.array(k), np.array(v)) for k, v in self.layers()], self.position)

    # -- writing (used by the model forward) -----------------------------------------------------------------------

    def append(self, layer: int, k_new: F32, v_new: F32) -> tuple[F32, F32, int]:
        """Append this step's keys/values (``[num_kv_heads, t, head_dim]``) to one layer.

        Returns (K, V, first_position): every key the new queries may need, i.e. the stored window plus the new
        tokens, and the absolute position of K's first token. ``position`` itself only moves on ``advance``,
        which the forward calls once after all layers.
        """
        t = k_new.shape[1]
        window = self.spec.layer_windows[layer]
        length = self._len[layer]
        buf_k, buf_v = self._k[layer], self._v[layer]
        if length + t > buf_k.shape[1]:
            keep = length if window is None else min(length, window)
            capacity = max(2 * (keep + t), 16) if window is None else 2 * window + t
            new_k = np.empty((self.spec.num_kv_heads, capacity, self.spec.head_dim), dtype=KV_DTYPE)
            new_v = np.empty_like(new_k)
            new_k[:, :keep] = buf_k[:, length - keep : length]
            new_v[:, :keep] = buf_v[:, length - keep : length]
            self._k[layer], self._v[layer] = buf_k, buf_v = new_k, new_v
            length = keep
        buf_k[:, length : length + t] = k_new
        buf_v[:, length : length + t] = v_new
        length += t
        self._len[layer] = length
        first = self.position + t - length
        return buf_k[:, :length], buf_v[:, :length], first

    def advance(self, t: int) -> None:
        self.position += t
