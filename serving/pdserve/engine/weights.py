"""Loading weights from the ``*.safetensors`` files of a Hugging Face checkpoint directory.

* Tensors are read with ``safetensors``' numpy backend. bfloat16 is not a numpy dtype, so BF16 tensors are
  read as their raw little-endian uint16 bits (offsets from the safetensors header) and widened to float32
  by shifting them into the high half of a uint32.
* Every weight is converted to float32 in memory: the engine computes in float32 whatever the storage dtype.
* ``weights_checksum`` is a sha256 over all tensors of the directory in sorted-name order (name, storage dtype,
  shape, raw stored bytes), so it is independent of file sharding and changes with any weight.
* Two layouts of Mixtral experts are accepted: the hub one (``block_sparse_moe.experts.{e}.w1/w2/w3``) and the
  fused one transformers 5 uses in memory (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors import safe_open

from .config import ModelConfig
from .errors import CheckpointError, MissingTensorError, TensorShapeError

F32 = npt.NDArray[np.float32]

_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def bf16_bits_to_f32(bits: npt.NDArray[np.uint16]) -> F32:
    """Widen raw bfloat16 bit patterns to float32 (exact: bf16 is the top half of an f32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class _TensorInfo:
    file: Path
    dtype: str  # safetensors dtype tag: F32, F16, BF16, ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsCheckpoint:
    """Index of every tensor in the ``*.safetensors`` files of one directory."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors file in {self.directory}")
        self._infos: dict[str, _TensorInfo] = {}
        for file in files:
            for name, info in _read_header(file).items():
                if name in self._infos:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {self._infos[name].file.name} and {file.name}"
                    )
                self._infos[name] = info

    def names(self) -> list[str]:
        return sorted(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def storage_dtype(self) -> str:
        """The storage dtype of the floating tensors ("float32", "float16", "bfloat16"), or "mixed"."""
        kinds = {_DTYPE_NAMES.get(i.dtype, i.dtype) for i in self._infos.values()}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def _info(self, name: str) -> _TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise MissingTensorError(name, str(self.directory)) from None

    def raw(self, name: str) -> bytes:
        info = self._info(name)
        with info.file.open("rb") as fh:
            fh.seek(info.begin)
            data = fh.read(info.end - info.begin)
        if len(data) != info.end - info.begin:
            raise CheckpointError(f"{info.file} is truncated inside tensor {name!r}")
        return data

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> F32:
        """The tensor as a float32 array; with ``shape``, check it first (error names the tensor)."""
        info = self._info(name)
        if shape is not None and info.shape != shape:
            raise TensorShapeError(f"tensor {name!r} has shape {list(info.shape)}, expected {list(shape)}")
        if info.dtype == "BF16":
            bits = np.frombuffer(self.raw(name), dtype="<u2").reshape(info.shape)
            return bf16_bits_to_f32(bits)
        if info.dtype not in _NUMPY_DTYPES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {info.dtype} (need F32, F16 or BF16)")
        with safe_open(str(info.file), framework="numpy") as fh:
            array = fh.get_tensor(name)
        return np.ascontiguousarray(array, dtype=np.float32)

    def weights_checksum(self) -> str:
        """sha256 over (name, dtype, shape, raw bytes) of every tensor in sorted-name order."""
        digest = hashlib.sha256()
        for name in self.names():
            info = self._infos[name]
            header = json.dumps([name, info.dtype, list(info.shape)], separators=(",", ":")).encode()
            digest.update(struct.pack("<Q", len(header)))
            digest.update(header)
            for chunk in _iter_chunks(info):
                digest.update(chunk)
        return digest.hexdigest()


def _iter_chunks(info: _TensorInfo, size: int = 1 << 24) -> Iterator[bytes]:
    with info.file.open("rb") as fh:
        fh.seek(info.begin)
        remaining = info.end - info.begin
        while remaining:
            chunk = fh.read(min(size, remaining))
            if not chunk:
                raise CheckpointError(f"{info.file} is truncated")
            remaining -= len(chunk)
            yield chunk


def _read_header(file: Path) -> dict[str, _TensorInfo]:
    """Parse a safetensors header: u64 little-endian length, JSON, then the byte buffer."""
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{file} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file} has a malformed safetensors header: {exc}") from exc
    base = 8 + length
    out: dict[str, _TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = _TensorInfo(file, entry["dtype"], tuple(int(d) for d in entry["shape"]), base + begin, base + end)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Engine-side weight structures (float32, laid out for ``x @ W`` with rows = tokens).


@dataclass
class DenseMlpWeights:
    gate_up: F32  # [hidden, 2 * intermediate]: gate columns first, then up
    down: F32  # [intermediate, hidden]
    gate_up_bias: F32 | None = None
    down_bias: F32 | None = None


@dataclass
class MoeMlpWeights:
    router: F32  # [hidden, num_experts]
    gate_up: F32  # [num_experts, hidden, 2 * intermediate]
    down: F32  # [num_experts, intermediate, hidden]


@dataclass
class LayerWeights:
    input_norm: F32  # [hidden]
    post_attention_norm: F32  # [hidden]
    qkv: F32  # [hidden, (heads + 2 * kv_heads) * head_dim]
    qkv_bias: F32 | None
    o: F32  # [heads * head_dim, hidden]
    o_bias: F32 | None
    mlp: DenseMlpWeights | MoeMlpWeights


@dataclass
class ModelWeights:
    embed: F32  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: F32  # [hidden]
    lm_head: F32  # [hidden, vocab]


def load_model_weights(ckpt: SafetensorsCheckpoint, cfg: ModelConfig) -> ModelWeights:
    """Gather and reshape every tensor the architecture needs; raise MissingTensorError naming any absent one."""
    h, v = cfg.hidden_size, cfg.vocab_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    embed = ckpt.get("model.embed_tokens.weight", (v, h))
    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        wq = ckpt.get(attn + "q_proj.weight", (q_out, h))
        wk = ckpt.get(attn + "k_proj.weight", (kv_out, h))
        wv = ckpt.get(attn + "v_proj.weight", (kv_out, h))
        qkv = np.ascontiguousarray(np.concatenate([wq, wk, wv], axis=0).T)
        qkv_bias = None
        if cfg.qkv_bias:
            qkv_bias = np.concatenate(
                [
                    ckpt.get(attn + "q_proj.bias", (q_out,)),
                    ckpt.get(attn + "k_proj.bias", (kv_out,)),
                    ckpt.get(attn + "v_proj.bias", (kv_out,)),
                ]
            )
        o = np.ascontiguousarray(ckpt.get(attn + "o_proj.weight", (h, q_out)).T)
        o_bias = ckpt.get(attn + "o_proj.bias", (h,)) if cfg.o_bias else None
        mlp = _load_moe(ckpt, cfg, p) if cfg.moe is not None else _load_dense_mlp(ckpt, cfg, p)
        layers.append(
            LayerWeights(
                input_norm=ckpt.get(p + "input_layernorm.weight", (h,)),
                post_attention_norm=ckpt.get(p + "post_attention_layernorm.weight", (h,)),
                qkv=qkv,
                qkv_bias=qkv_bias,
                o=o,
                o_bias=o_bias,
                mlp=mlp,
            )
        )
    final_norm = ckpt.get("model.norm.weight", (h,))
    if cfg.tie_word_embeddings:
        lm_head = np.ascontiguousarray(embed.T)
    else:
        lm_head = np.ascontiguousarray(ckpt.get("lm_head.weight", (v, h)).T)
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def _load_dense_mlp(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, p: str) -> DenseMlpWeights:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    gate = ckpt.get(p + "mlp.gate_proj.weight", (inter, h))
    up = ckpt.get(p + "mlp.up_proj.weight", (inter, h))
    down = ckpt.get(p + "mlp.down_proj.weight", (h, inter))
    weights = DenseMlpWeights(
        gate_up=np.ascontiguousarray(np.concatenate([gate, up], axis=0).T), down=np.ascontiguousarray(down.T)
    )
    if cfg.mlp_bias:
        weights.gate_up_bias = np.concatenate(
            [ckpt.get(p + "mlp.gate_proj.bias", (inter,)), ckpt.get(p + "mlp.up_proj.bias", (inter,))]
        )
        weights.down_bias = ckpt.get(p + "mlp.down_proj.bias", (h,))
    return weights


def _load_moe(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, p: str) -> MoeMlpWeights:
    assert cfg.moe is not None
    h, inter, e = cfg.hidden_size, cfg.intermediate_size, cfg.moe.num_experts
    if p + "mlp.experts.gate_up_proj" in ckpt:  # transformers 5 fused layout
        router = ckpt.get(p + "mlp.gate.weight", (e, h))
        gate_up = ckpt.get(p + "mlp.experts.gate_up_proj", (e, 2 * inter, h)).transpose(0, 2, 1)
        down = ckpt.get(p + "mlp.experts.down_proj", (e, h, inter)).transpose(0, 2, 1)
    else:  # hub layout: w1 = gate, w3 = up, w2 = down
        moe = p + "block_sparse_moe."
        router = ckpt.get(moe + "gate.weight", (e, h))
        gate_up = np.stack(
            [
                np.concatenate(
                    [
                        ckpt.get(f"{moe}experts.{x}.w1.weight", (inter, h)),
                        ckpt.get(f"{moe}experts.{x}.w3.weight", (inter, h)),
                    ],
                    axis=0,
                ).T
                for x in range(e)
            ]
        )
        down = np.stack([ckpt.get(f"{moe}experts.{x}.w2.weight", (h, inter)).T for x in range(e)])
    return MoeMlpWeights(
        router=np.ascontiguousarray(router.T),
        gate_up=np.ascontiguousarray(gate_up),
        down=np.ascontiguousarray(down),
    )
