"""What one pull receives: the destination arrays its streams fill (`Assembly`, each digest unit hashed as soon as
its last byte lands) and the state its streams share and must agree on (`PullState`: manifest, checksum, digests)."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from pdserve.kv.arrays import kv_layers
from pdserve.kv.blob import DIGEST_BYTES, Layer, Manifest, blob_checksum, flat_views, unit_digests
from pdserve.kv.errors import KVTransferError
from pdserve.kv.protocol import DATA_HEADER, MAX_CONTROL_PAYLOAD, Chunk, Frame, FrameType, chunk_plan
from pdserve.kv.threads import verify_threads
from pdserve.kv.wire import FrameSocket


class Assembly:
    """Destination arrays for one pull from row `first_row` on, filled by the stream threads; hashes each digest unit
    on a verify thread as soon as its last byte lands, and checks them against the announced ones at the end."""

    def __init__(self, manifest: Manifest, first_row: int) -> None:
        self.manifest = manifest
        self.units = manifest.units
        self.plan = chunk_plan(manifest, first_row)
        self.layers: list[Layer] = kv_layers(manifest.layers)
        self._views = flat_views(self.layers)
        self._lock = threading.Lock()
        self._expected = {(chunk.layer, chunk.part, chunk.offset): chunk for chunk in self.plan}
        self._missing: dict[int, int] = {}  # unit -> bytes of it still to come
        for chunk in self.plan:
            for unit, overlap in self._overlaps(chunk):
                self._missing[unit] = self._missing.get(unit, 0) + overlap
        self._hashes: list[Future[list[bytes]]] = []
        self._hashed: list[list[int]] = []

    def _overlaps(self, chunk: Chunk) -> list[tuple[int, int]]:
        array, end = 2 * chunk.layer + chunk.part, chunk.offset + chunk.length
        overlaps = []
        for unit in self.units.covering(array, chunk.offset, end):
            _array, start, stop = self.units.span(unit)
            overlaps.append((unit, min(stop, end) - max(start, chunk.offset)))
        return overlaps

    def target(self, layer: int, part: int, offset: int, length: int) -> tuple[Chunk, memoryview]:
        """Where a DATA payload goes, if it is a chunk of the plan no stream has received yet (it then counts as
        received): the chunk and the slice of its destination array."""
        with self._lock:
            chunk = self._expected.pop((layer, part, offset), None)
        if chunk is None or chunk.length != length:
            raise KVTransferError(
                "protocol",
                f"got chunk (layer {layer}, part {part}, offset {offset}, {length} bytes), which this pull was not "
                "to receive (or received twice)",
            )
        return chunk, self._views[2 * layer + part][offset : offset + length]

    @property
    def chunks_missing(self) -> int:
        with self._lock:
            return len(self._expected)

    def landed(self, chunk: Chunk) -> None:
        """A chunk's bytes are in place (and passed their frame CRC): hash every unit it completed."""
        complete = []
        with self._lock:
            for unit, overlap in self._overlaps(chunk):
                self._missing[unit] -= overlap
                if self._missing[unit] == 0:
                    complete.append(unit)
            if complete:
                self._hashes.append(verify_threads().submit(unit_digests, self._views, self.units, complete))
                self._hashed.append(complete)

    def receive(self, channel: FrameSocket, timeout: float) -> Frame | None:
        """Read the next frame that is not a KEEPALIVE: DATA goes straight into its destination, its CRC checked
        there (None is returned); any other frame is returned, CRC checked."""
        data_max = DATA_HEADER.size + self.manifest.chunk_bytes
        digests = self.units.total * DIGEST_BYTES
        while True:
            header, deadline = channel.read_header(timeout, max(data_max, digests, MAX_CONTROL_PAYLOAD))
            if header.type is FrameType.DATA and DATA_HEADER.size <= header.length <= data_max:
                sub = channel.recv_bytes(DATA_HEADER.size, deadline, timeout)
                layer, part, offset = DATA_HEADER.unpack(sub)
                chunk, view = self.target(layer, part, offset, header.length - DATA_HEADER.size)
                channel.recv_into(view, deadline, timeout)
                header.check_crc(sub, view)
                self.landed(chunk)
                return None
            if header.type is FrameType.DATA:
                raise KVTransferError(
                    "protocol",
                    f"a DATA frame carries {DATA_HEADER.size} to {data_max} bytes here, "
                    f"its header claims {header.length}",
                )
            limit = digests if header.type is FrameType.DIGESTS else MAX_CONTROL_PAYLOAD
            if header.length > limit:
                raise KVTransferError(
                    "protocol",
                    f"a {header.type.name} frame here carries at most {limit} bytes, its header claims {header.length}",
                )
            payload = channel.recv_bytes(header.length, deadline, timeout)
            header.check_crc(payload)
            if header.type is not FrameType.KEEPALIVE:
                return Frame(header.type, payload)

    async def verify(self, digests: bytes, checksum: str) -> None:
        """The announced unit digests hash to the announced checksum, and every unit received has its digest."""
        if len(digests) != self.units.total * DIGEST_BYTES:
            raise KVTransferError(
                "protocol", f"DIGESTS carries {len(digests)} bytes, expected {self.units.total * DIGEST_BYTES}"
            )
        manifest = self.manifest
        if blob_checksum(manifest.meta, manifest.layers, manifest.unit_rows, digests) != checksum:
            raise KVTransferError("checksum", "the announced unit digests do not match the blob checksum")
        if self.chunks_missing or any(self._missing.values()):
            raise KVTransferError("protocol", f"transfer ended with {self.chunks_missing} chunks not received")
        computed = await asyncio.gather(*(asyncio.wrap_future(future) for future in self._hashes))
        for units, digests_of in zip(self._hashed, computed, strict=True):
            for unit, digest in zip(units, digests_of, strict=True):
                if digest != digests[unit * DIGEST_BYTES : (unit + 1) * DIGEST_BYTES]:
                    array, start, _end = self.units.span(unit)
                    raise KVTransferError(
                        "checksum", f"layer {array // 2} {'KV'[array % 2]} bytes from {start} do not match their digest"
                    )


@dataclass
class PullState:
    request_id: str
    expected_checksum: str | None
    expected_fingerprint: str | None
    streams: int
    first_row: int = 0
    max_bytes: int | None = None  # the most KV this pull may allocate (what the caller's request can hold)
    pull_id: str = field(default_factory=lambda: secrets.token_hex(16))  # the server shares chunks by it
    trace: dict[str, str] = field(default_factory=dict)  # the caller's traceparent, outside the END MAC
    assembly: Assembly | None = None
    manifest_bytes: bytes | None = None
    announced: str | None = None  # the checksum END announced
    digests: bytes | None = None  # the unit digests stream 0 received
    lock: threading.Lock = field(default_factory=threading.Lock)  # the stream threads share this state

    def end_checksum(self, checksum: object) -> None:
        """Every stream's END must announce the same checksum (the one expected, when the caller knows it)."""
        if not isinstance(checksum, str) or not checksum:
            raise KVTransferError("protocol", "END carries no blob checksum")
        if self.expected_checksum is not None and checksum != self.expected_checksum:
            raise KVTransferError("checksum", "the prefill server's END announces a different checksum")
        with self.lock:
            self._agree(checksum)

    def _agree(self, checksum: str) -> None:
        if self.announced is not None and checksum != self.announced:
            raise KVTransferError("protocol", "streams of one pull ended with different checksums")
        self.announced = checksum

    def assembly_for(self, manifest_bytes: bytes) -> Assembly:
        """The shared destination, created by whichever stream's manifest arrives first; all must agree."""
        with self.lock:
            return self._assembly_for(manifest_bytes)

    def _assembly_for(self, manifest_bytes: bytes) -> Assembly:
        try:
            manifest = Manifest.from_bytes(manifest_bytes)
        except (ValueError, KeyError, TypeError) as error:
            raise KVTransferError("protocol", f"malformed manifest: {error}") from error
        if self.assembly is not None:
            # A stream whose PULL came after prefill sealed a streamed blob sees its checksum, the others an empty
            # one; everything else must agree (END's MAC covers each stream's manifest and END's checksum).
            if dataclasses.replace(manifest, checksum="") != dataclasses.replace(self.assembly.manifest, checksum=""):
                raise KVTransferError("protocol", "streams of one pull received different manifests")
            return self.assembly
        self._check(manifest)
        try:
            assembly = Assembly(manifest, self.first_row)
        except ValueError as error:
            raise KVTransferError("protocol", f"cannot pull from row {self.first_row}: {error}") from error
        self.manifest_bytes = manifest_bytes
        self.assembly = assembly
        return self.assembly

    def _check(self, manifest: Manifest) -> None:
        if manifest.meta.request_id != self.request_id:
            raise KVTransferError("protocol", f"asked for {self.request_id!r}, got {manifest.meta.request_id!r}")
        if self.expected_fingerprint is not None and manifest.meta.fingerprint != self.expected_fingerprint:
            raise KVTransferError(
                "fingerprint",
                f"KV fingerprint {manifest.meta.fingerprint!r} does not match this decoder's "
                f"{self.expected_fingerprint!r}",
            )
        # A blob still being computed has no checksum yet (its END carries it).
        if self.max_bytes is not None and manifest.nbytes > self.max_bytes:
            raise KVTransferError(
                "protocol",
                f"the manifest announces {manifest.nbytes} bytes of KV, more than this request's {self.max_bytes}",
            )
        if manifest.checksum and self.expected_checksum is not None and manifest.checksum != self.expected_checksum:
            raise KVTransferError("checksum", "the prefill server's manifest announces a different checksum")
