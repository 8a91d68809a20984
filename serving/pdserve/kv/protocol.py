"""Wire format of the KV channel.

Every frame is a 20-byte header followed by a payload:

    magic "PDKV" | version u8 | type u8 | flags u16 | payload length u64 | crc32c u32

The CRC-32C (Castagnoli, hardware-accelerated through google-crc32c: SSE4.2 / ARMv8 CRC instructions, several
times zlib's crc32) covers the first 16 header bytes and the payload. It detects every error burst of up to 32 bits
and every 1-3 bit error in frames up to ~16 MiB (our frames are <= chunk_bytes, 1 MiB by default), and misses a
random corruption with probability 2^-32: it catches what a NIC, a middlebox or memory does to a frame in transit.
It is no defence against a deliberate edit (the digests, the checksum and END's MAC are; and TLS).
DATA payloads start with a 13-byte sub-header (layer u32, part u8 (0 = K, 1 = V), byte offset u64).
Control payloads (PULL, MANIFEST, ACK, ERROR, END) are JSON.

A pull's N streams (N connections) share one plan of chunks: every stream's PULL names the same pull id (random,
fresh per pull), each stream takes the next chunk not yet taken whenever it has sent its last, and END says how many
this stream carried. So a slower TCP flow carries fewer chunks instead of holding the pull's tail.

A pull may be served while prefill is still computing the blob (a streamed lease entry): MANIFEST then carries the
layout with an empty checksum, each stream sends its chunks as they are computed (in any order; the DATA sub-header
says where each goes), KEEPALIVE frames while it waits, and END carries the blob checksum once prefill sealed it.
PULL may name a `first_row` (block): only bytes from that leading row of each array on are sent, and stream 0
sends DIGESTS (every unit's digest) before END, so decode verifies the units it got against the blob checksum.
PULL may carry the puller's W3C `traceparent` (pdserve.common.tracing); the server then serves the stream in a span of
that trace. It places a span and nothing else, so the END MAC leaves it out and a server that ignores it is unchanged.

What each check detects:
- CRC-32C per frame (above): accidental corruption of any frame in transit or in a buffer; not an attacker.
- BLAKE3-256 per digest unit (unit_rows blocks of one layer's K or V, pdserve.kv.blob): any change to a unit's bytes,
  accidental or deliberate (collision resistance 2^128), once the unit digests are known to be genuine.
- Blob checksum (sha256 over manifest meta, layout and the unit digests): pins the digests, so one 64-hex string from
  signed kv_transfer_params (or from END) pins every byte, dtype, shape and the fingerprint.
- END MAC (HMAC-SHA256 under the connection's session key, derived from the KV key and both handshake nonces): that
  the manifest this stream received and the blob checksum END announces come from the authenticated server on this
  connection. With early dispatch decode has no checksum from signed params, so without it an active attacker on a
  non-TLS path could swap the KV together with its digests, checksum and CRCs. Decode verifies every stream's MAC
  before it accepts any KV. (DATA, DIGESTS, KEEPALIVE, ERROR and ACK_OK are not MACed: data frames are pinned by the
  MACed checksum; a forged ERROR or ACK_OK can only fail a transfer or mislead about a lease, which an on-path attacker
  can do anyway by dropping packets.)
- HMAC challenge-response (pdserve.kv.auth): both ends hold the key; a replayed handshake fails (fresh nonces).

A connection opens with HELLO (client nonce) -> CHALLENGE (server nonce + proof) -> AUTH (client proof). Until AUTH
is verified the server reads only frames of at most MAX_HANDSHAKE_PAYLOAD bytes (a longer one is refused from its
header, unread) within one handshake deadline; afterwards request frames of at most MAX_REQUEST_PAYLOAD.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from google_crc32c import extend as _crc32c_extend

from pdserve.kv.blob import Manifest
from pdserve.kv.errors import Cause, KVTransferError

MAGIC = b"PDKV"
# 2: crc32c frames, streamed blobs, range pulls, per-block BLAKE3 digests; 3: END MACed; 4: the streams of a pull
# share its chunks (PULL names a pull id; each stream takes the next chunk when ready, END counts what it sent)
VERSION = 4
HEADER = struct.Struct("!4sBBHQI")
DATA_HEADER = struct.Struct("!IBQ")
MAX_CONTROL_PAYLOAD = 4 << 20
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
# Before a client has authenticated the server reads frames of at most this payload: HELLO carries a 32-byte nonce,
# AUTH a 32-byte HMAC. A header claiming more is refused without reading the payload.
MAX_HANDSHAKE_PAYLOAD = 64
# After it, a client sends only PULL and ACK (a small JSON object naming a request id).
MAX_REQUEST_PAYLOAD = 64 << 10


class FrameType(enum.IntEnum):
    HELLO = 1  # client nonce
    CHALLENGE = 2  # server nonce + server proof
    AUTH = 3  # client proof
    PULL = 4
    MANIFEST = 5
    DATA = 6
    END = 7
    ACK = 8
    ACK_OK = 9
    ERROR = 10
    KEEPALIVE = 11  # server -> client while a pull waits for prefill to open or fill the blob; resets read timeouts
    DIGESTS = 12  # stream 0, before END: every unit's digest (binary, DIGEST_BYTES each, in unit order)


@dataclass(frozen=True)
class Frame:
    type: FrameType
    payload: bytes

    def json(self) -> dict[str, Any]:
        try:
            body = json.loads(self.payload)
        except ValueError as error:
            raise KVTransferError("protocol", f"{self.type.name} frame payload is not JSON") from error
        if not isinstance(body, dict):
            raise KVTransferError("protocol", f"{self.type.name} frame payload is not a JSON object")
        return body


@dataclass(frozen=True)
class Chunk:
    layer: int
    part: int
    offset: int
    length: int


def chunk_plan(manifest: Manifest, first_row: int = 0) -> list[Chunk]:
    """The chunks of a blob from leading row (block) `first_row` on, in layer order; the streams of a pull take them
    in this order, each the next one as soon as it has sent its last (pdserve.kv.share)."""
    plan: list[Chunk] = []
    units = manifest.units
    for index, pair in enumerate(manifest.layers):
        for part, spec in enumerate(pair):
            start = units.row_offset(2 * index + part, first_row)
            for offset in range(start, spec.nbytes, manifest.chunk_bytes):
                plan.append(Chunk(index, part, offset, min(manifest.chunk_bytes, spec.nbytes - offset)))
    return plan


def _header(frame_type: FrameType, payload_len: int, crc: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, frame_type, 0, payload_len, crc)


def crc32c(data: bytes | memoryview, crc: int = 0) -> int:
    # google-crc32c takes bytes or buffer objects such as numpy arrays, not memoryviews.
    return int(_crc32c_extend(crc, data if isinstance(data, bytes) else np.frombuffer(data, np.uint8)))


def encode_header(frame_type: FrameType, *payload_parts: bytes | memoryview) -> bytes:
    """The header for a payload made of `payload_parts` (sent after it without being joined)."""
    length = sum(len(part) for part in payload_parts)
    crc = crc32c(HEADER.pack(MAGIC, VERSION, frame_type, 0, length, 0)[:16])
    for part in payload_parts:
        crc = crc32c(part, crc)
    return _header(frame_type, length, crc)


def json_payload(body: dict[str, Any]) -> bytes:
    """A control frame's payload: canonical JSON."""
    return json.dumps(body, sort_keys=True).encode()


def error_body(cause: Cause, message: str) -> bytes:
    return json_payload({"cause": cause, "message": message})


@dataclass(frozen=True)
class Header:
    """A frame header read and checked (magic, version, type, length bound), its payload not yet read."""

    type: FrameType
    length: int
    crc: int
    raw: bytes

    def check_crc(self, *payload_parts: bytes | memoryview) -> None:
        crc = crc32c(self.raw[:16])
        for part in payload_parts:
            crc = crc32c(part, crc)
        if crc != self.crc:
            raise KVTransferError("checksum", f"frame crc32c mismatch in a {self.type.name} frame")


def check_header(magic: bytes, version: int, raw_type: int, length: int, max_payload: int) -> None:
    # A corrupted header usually shows up here before its crc can be checked; report it as a checksum failure
    # because the peer spoke the protocol up to this frame.
    if magic != MAGIC:
        raise KVTransferError("checksum", f"expected frame magic {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise KVTransferError("protocol", f"unsupported protocol version {version} (this side speaks {VERSION})")
    if raw_type not in FrameType._value2member_map_:
        known = ", ".join(f"{t.value} ({t.name})" for t in FrameType)
        raise KVTransferError("checksum", f"unknown frame type {raw_type} (expected one of {known})")
    if length > max_payload:
        raise KVTransferError(
            "checksum",
            f"a {FrameType(raw_type).name} frame here may carry at most {max_payload} "
            f"bytes, its header claims {length}",
        )


def raise_if_error(frame: Frame) -> None:
    if frame.type is FrameType.ERROR:
        body = frame.json()
        cause = str(body.get("cause", "protocol"))
        known: tuple[Cause, ...] = ("auth", "not_found", "expired", "protocol", "checksum", "capacity")
        matched: Cause = next((item for item in known if item == cause), "protocol")
        raise KVTransferError(matched, f"server: {body.get('message', '')}")


def expect(frame: Frame, frame_type: FrameType) -> Frame:
    raise_if_error(frame)
    if frame.type is not frame_type:
        raise KVTransferError("protocol", f"expected a {frame_type.name} frame, got {frame.type.name}")
    return frame
