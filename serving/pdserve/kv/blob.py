"""The unit the KV channel moves: L layers of (K, V) numpy arrays plus request metadata.

The blob checksum is sha256 over the canonical manifest (metadata, dtypes, shapes) followed by one sha256 digest
per layer (over K's bytes then V's bytes). Per-layer digests let decode verify layers as they complete instead of
hashing the whole blob after the last byte arrives.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

CHECKSUM_PREFIX = "sha256:"
ALLOWED_DTYPE_KINDS = "biuf"

Layer = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class KVMeta:
    request_id: str
    token_count: int
    fingerprint: str


@dataclass(frozen=True)
class ArraySpec:
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def of(cls, array: np.ndarray) -> ArraySpec:
        return cls(array.dtype.str, tuple(int(d) for d in array.shape))


@dataclass(frozen=True)
class Manifest:
    """What decode learns before the bytes: metadata, layer layout, chunking and the announced checksum."""

    meta: KVMeta
    layers: tuple[tuple[ArraySpec, ArraySpec], ...]
    chunk_bytes: int
    checksum: str

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def to_bytes(self) -> bytes:
        body = _layout_json(self.meta, self.layers)
        body["chunk_bytes"] = self.chunk_bytes
        body["checksum"] = self.checksum
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        body = json.loads(raw)
        meta = KVMeta(str(body["request_id"]), int(body["token_count"]), str(body["fingerprint"]))
        layers = tuple(
            (_spec_from_json(layer["k"]), _spec_from_json(layer["v"])) for layer in body["layers"]
        )
        return cls(meta, layers, int(body["chunk_bytes"]), str(body["checksum"]))


@dataclass(frozen=True)
class KVBlob:
    meta: KVMeta
    layers: list[Layer]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def _spec_from_json(raw: dict[str, Any]) -> ArraySpec:
    dtype = np.dtype(str(raw["dtype"]))
    if dtype.kind not in ALLOWED_DTYPE_KINDS:
        raise ValueError(f"manifest dtype {dtype.str!r} is not a numeric dtype")
    return ArraySpec(dtype.str, tuple(int(d) for d in raw["shape"]))


def _layout_json(meta: KVMeta, layers: tuple[tuple[ArraySpec, ArraySpec], ...]) -> dict[str, Any]:
    return {
        "request_id": meta.request_id,
        "token_count": meta.token_count,
        "fingerprint": meta.fingerprint,
        "layers": [{"k": k.to_json(), "v": v.to_json()} for k, v in layers],
    }


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    flat: memoryview = array.reshape(-1).view(np.uint8).data
    return flat


def layer_digest(layer: Layer) -> bytes:
    digest = hashlib.sha256()
    digest.update(as_bytes(layer[0]))
    digest.update(as_bytes(layer[1]))
    return digest.digest()


def blob_checksum(meta: KVMeta, specs: tuple[tuple[ArraySpec, ArraySpec], ...], layer_digests: list[bytes]) -> str:
    digest = hashlib.sha256(json.dumps(_layout_json(meta, specs), sort_keys=True).encode())
    for item in layer_digests:
        digest.update(item)
    return CHECKSUM_PREFIX + digest.hexdigest()


def validate_layers(layers: list[Layer]) -> list[Layer]:
    """Check the layers a caller hands in and return C-contiguous versions of them."""
    if not layers:
        raise ValueError("layers: a KV blob needs at least one layer")
    checked: list[Layer] = []
    for index, layer in enumerate(layers):
        if len(layer) != 2:
            raise ValueError(f"layers[{index}]: expected a (K, V) pair, got {len(layer)} items")
        pair = []
        for name, array in zip("KV", layer, strict=True):
            if not isinstance(array, np.ndarray):
                raise ValueError(f"layers[{index}].{name}: expected a numpy array, got {type(array).__name__}")
            if array.dtype.kind not in ALLOWED_DTYPE_KINDS:
                raise ValueError(f"layers[{index}].{name}: dtype {array.dtype} is not numeric")
            pair.append(np.ascontiguousarray(array))
        checked.append((pair[0], pair[1]))
    return checked


def build_manifest(meta: KVMeta, layers: list[Layer], chunk_bytes: int) -> Manifest:
    specs = tuple((ArraySpec.of(k), ArraySpec.of(v)) for k, v in layers)
    checksum = blob_checksum(meta, specs, [layer_digest(layer) for layer in layers])
    return Manifest(meta, specs, chunk_bytes, checksum)
