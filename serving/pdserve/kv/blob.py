"""The unit the KV channel moves: L layers of (K, V) numpy arrays plus request metadata.

Each array is cut into digest units: the whole array (`unit_rows` 0, pdserve's own servers) or `unit_rows` leading
rows at a time (vLLM's connector: one unit per KV block, so a pull of blocks [first, n) can be verified). Every unit
has a BLAKE3-256 digest (SIMD, several times sha256's speed, same 128-bit collision resistance); the blob checksum
is sha256 over the canonical manifest (metadata, dtypes, shapes, unit_rows) followed by every unit's digest in
order. So the checksum decode has from signed params (or from the authenticated server's END) pins every unit, and
decode verifies exactly the units it received against the digests that hash to it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

CHECKSUM_PREFIX = "sha256:"
DIGEST_BYTES = 32
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
    unit_rows: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    @property
    def units(self) -> Units:
        return Units(self.layers, self.unit_rows)

    def to_bytes(self) -> bytes:
        body = _layout_json(self.meta, self.layers, self.unit_rows)
        body["chunk_bytes"] = self.chunk_bytes
        body["checksum"] = self.checksum
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        body = json.loads(raw)
        meta = KVMeta(str(body["request_id"]), int(body["token_count"]), str(body["fingerprint"]))
        layers = tuple((_spec_from_json(layer["k"]), _spec_from_json(layer["v"])) for layer in body["layers"])
        return cls(meta, layers, int(body["chunk_bytes"]), str(body["checksum"]), int(body["unit_rows"]))


class Units:
    """The digest units of a layout: array a (= 2 * layer + part) has `count[a]` units of `size[a]` bytes (the last
    may be shorter), numbered from `first[a]` in one flat sequence over all arrays."""

    def __init__(self, layers: tuple[tuple[ArraySpec, ArraySpec], ...], unit_rows: int) -> None:
        if unit_rows < 0:
            raise ValueError(f"unit_rows: must be 0 (whole arrays) or positive, got {unit_rows}")
        self.unit_rows = unit_rows
        self.nbytes = [spec.nbytes for pair in layers for spec in pair]
        self.size: list[int] = []
        self.count: list[int] = []
        self.first: list[int] = []
        for pair in layers:
            for spec in pair:
                rows = spec.shape[0] if spec.shape else 1
                whole = unit_rows == 0 or rows == 0
                size = spec.nbytes if whole else unit_rows * (spec.nbytes // rows)
                self.first.append(sum(self.count))
                self.size.append(size)
                self.count.append(math.ceil(spec.nbytes / size) if size else 0)
        self.total = sum(self.count)

    def covering(self, array: int, start: int, end: int) -> range:
        """Flat indices of the units holding any byte of [start, end) of `array`."""
        size = self.size[array]
        if end <= start or not size:
            return range(0)
        return range(self.first[array] + start // size, self.first[array] + math.ceil(end / size))

    def span(self, unit: int) -> tuple[int, int, int]:
        """(array, start byte, end byte) of a flat unit index."""
        array = bisect.bisect_right(self.first, unit) - 1  # arrays without units share their successor's first
        start = (unit - self.first[array]) * self.size[array]
        return array, start, min(start + self.size[array], self.nbytes[array])

    def row_offset(self, array: int, row: int) -> int:
        """Where a pull from leading row `row` (a block) starts in `array`: the start of the unit holding it."""
        if row == 0:
            return 0
        if self.unit_rows == 0:
            raise ValueError(f"first_row {row}: this blob is verified in whole arrays, so it is pulled whole")
        # From the unit holding that row, so every unit sent is whole and can be verified.
        return min((row // self.unit_rows) * self.size[array], self.nbytes[array])


@dataclass(frozen=True)
class KVBlob:
    """What a pull returns; with `first_row` > 0 the leading rows before it were not sent (their bytes are
    undefined: decode had them already)."""

    meta: KVMeta
    layers: list[Layer]
    first_row: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def _spec_from_json(raw: dict[str, Any]) -> ArraySpec:
    dtype = np.dtype(str(raw["dtype"]))
    if dtype.kind not in ALLOWED_DTYPE_KINDS:
        raise ValueError(f"manifest dtype {dtype.str!r} is not a numeric dtype")
    return ArraySpec(dtype.str, tuple(int(d) for d in raw["shape"]))


def _layout_json(meta: KVMeta, layers: tuple[tuple[ArraySpec, ArraySpec], ...], unit_rows: int) -> dict[str, Any]:
    return {
        "request_id": meta.request_id,
        "token_count": meta.token_count,
        "fingerprint": meta.fingerprint,
        "layers": [{"k": k.to_json(), "v": v.to_json()} for k, v in layers],
        "unit_rows": unit_rows,
    }


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    flat: memoryview = array.reshape(-1).view(np.uint8).data
    return flat


def unit_digests(views: list[memoryview], units: Units, indices: list[int] | range) -> list[bytes]:
    """The BLAKE3 digests of these units (views: one flat byte view per array); blake3 releases the GIL, so a
    worker thread may run this beside the event loop."""
    digests = []
    for unit in indices:
        array, start, end = units.span(unit)
        digests.append(blake3.blake3(views[array][start:end]).digest())
    return digests


def blob_checksum(
    meta: KVMeta, specs: tuple[tuple[ArraySpec, ArraySpec], ...], unit_rows: int, digests: list[bytes] | bytes
) -> str:
    digest = hashlib.sha256(json.dumps(_layout_json(meta, specs, unit_rows), sort_keys=True).encode())
    digest.update(b"".join(digests) if isinstance(digests, list) else digests)
    return CHECKSUM_PREFIX + digest.hexdigest()


def flat_views(layers: list[Layer]) -> list[memoryview]:
    return [as_bytes(array) for pair in layers for array in pair]


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
