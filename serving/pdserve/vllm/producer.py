"""Prefill's worker: streams each prompt's completed KV blocks out of vLLM layer by layer, as it computes them, into a
lease entry of pdserve's store, which its KV server serves while it is filled, and seals the entry once the prompt is
complete (the checksum goes to the scheduler process through a result file)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from pdserve.kv import KVMeta, KVServer, KVTransferError, LeaseStore
from pdserve.kv.blob import ArraySpec
from pdserve.kv.entry import StoredKV
from pdserve.vllm.settings import ConnectorSettings
from pdserve.vllm.worker import ConnectorWorker, SaveSpec, log, result_path, run_on, write_json_atomically

OWNERS_KEPT = 4096


@dataclass
class _Stream:
    """A request whose prompt is being streamed into its lease entry, step by step."""

    request_id: str
    lease_id: str
    stored: StoredKV
    steps: int = 0


class ProducerWorker(ConnectorWorker):
    """Prefill: streams each prompt's completed blocks out of vLLM layer by layer into a lease entry, which the KV
    server serves while it is filled; seals it when the prompt is complete."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        super().__init__(settings, vllm_config, kv_caches)
        shutil.rmtree(settings.worker_dir, ignore_errors=True)
        settings.worker_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(
            settings.worker_dir / "fingerprint.json", {"fields": self.fields, "digest": self.fingerprint}
        )
        # The store digests each added block on its own threads (BLAKE3), never on vLLM's forward thread.
        self.store = LeaseStore(
            settings.kv_store_bytes,
            default_lease_s=settings.kv_lease_seconds,
            metrics=self.metrics,
            thread_initializer=run_on(self.cpus),
        )
        self.server = KVServer(
            self.store,
            settings.key,
            host=settings.bind_host,
            port=settings.port,
            ssl_context=settings.server_tls(),
            io_timeout_s=settings.kv_read_timeout_seconds,
            limits=settings,  # the listener's admission limits: the KV channel's settings include them
            metrics=self.metrics,
            open_wait_s=settings.kv_open_wait_seconds,  # early dispatch: decode may ask before prefill opened it
        )
        self.loop.run(self._start())
        self.write_instance("kv_producer", settings.advertise_host, settings.port)
        self.layer_index = {name: index for index, name in enumerate(self.layer_names)}
        self._streams: dict[str, _Stream] = {}
        self._step_layers: set[int] = set()  # the layers this step has saved so far
        self._owners: OrderedDict[str, str] = OrderedDict()  # lease id -> the request that opened it
        log.info(
            "pdstack connector: KV server on %s:%d, fingerprint %s, connector threads on CPUs %s",
            settings.bind_host,
            settings.port,
            self.fingerprint,
            sorted(self.cpus),
        )

    async def _start(self) -> None:
        await self.server.start()
        self.store.start_reaper()

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, saves: list[SaveSpec]) -> None:
        """Inside the forward, once `layer_name` is computed: add this step's completed blocks of that layer."""
        if not self._step_layers:  # the step's first layer: open the entries of requests starting their prefill
            for spec in saves:
                if spec.open and spec.request_id not in self._streams:
                    self._open(spec)
        index = self.layer_index[layer_name]
        for spec in saves:
            stream = self._streams.get(spec.request_id)
            if stream is None or not spec.block_ids:
                continue
            ids = torch.tensor(spec.block_ids, dtype=torch.long, device=kv_layer.device)
            size = self.block_bytes[layer_name]
            try:
                stream.stored.write(index, 0, spec.first_block * size, len(ids) * size, _gather(kv_layer, ids))
            except ValueError as error:  # sealed or failed under us (lease expired, replaced): it is over
                self._drop(spec.request_id, f"cannot add layer {layer_name}: {error}")
        self._step_layers.add(index)
        if len(self._step_layers) == len(self.layer_names):
            self._seal_completed(saves)

    def _seal_completed(self, saves: list[SaveSpec]) -> None:
        """Every layer of the step is in: seal the prompts it completes now, not after the forward, so the KV server
        sends END while the forward's last MLP, norm and sampling still run (at 2K tokens on the bench's llama that
        tail is ~25 ms, on decode's critical path under early dispatch). finish_step writes their checksums."""
        for spec in saves:
            stream = self._streams.get(spec.request_id)
            if spec.seal and stream is not None:
                with contextlib.suppress(ValueError):  # a layer missing: finish_step's seal fails and reports it
                    stream.stored.seal()

    def _open(self, spec: SaveSpec) -> _Stream | None:
        specs = tuple(
            (
                ArraySpec(np.dtype(np.uint8).str, (spec.total_blocks, self.block_bytes[name])),
                ArraySpec(np.dtype(np.uint8).str, (0,)),
            )
            for name in self.layer_names
        )
        meta = KVMeta(spec.lease_id, spec.num_tokens, self.fingerprint)
        replace = self._owners.get(spec.lease_id) == spec.request_id  # never another request's KV
        try:
            # One digest unit per KV block (a row), so decode can pull only the blocks its prefix cache lacks.
            stored = self.store.open(spec.lease_id, meta, specs, replace=replace, unit_rows=1)
        except (KVTransferError, ValueError) as error:
            log.error("pdstack connector: request %s: cannot hold its KV: %s", spec.request_id, error)
            return None
        self._owners[spec.lease_id] = spec.request_id
        while len(self._owners) > OWNERS_KEPT:
            self._owners.popitem(last=False)
        stream = _Stream(spec.request_id, spec.lease_id, stored)
        self._streams[spec.request_id] = stream
        return stream

    def finish_step(self, saves: list[SaveSpec], aborts: list[str]) -> None:
        """After the forward: log what each request streamed, seal the prompts this step completed, drop the
        entries of requests the scheduler finished before their prompt was complete."""
        self._step_layers.clear()
        for request_id in aborts:
            if self._drop(request_id, "its request ended before its prompt was prefilled (aborted or failed)"):
                log.info("pdstack connector: request %s ended mid-prefill; its KV entry is aborted", request_id)
        for spec in saves:
            stream = self._streams.get(spec.request_id)
            if stream is None:
                continue
            stream.steps += 1
            log.info(
                "pdstack connector: lease %s step %d: blocks [%d, %d) of %d added, %d prompt tokens computed, %d "
                "bytes served so far",
                spec.lease_id,
                stream.steps,
                spec.first_block,
                spec.first_block + len(spec.block_ids),
                spec.total_blocks,
                spec.computed_tokens,
                stream.stored.sent_unsealed,
            )
            if spec.seal:
                self._seal(stream, spec)
            self.store.renew(spec.lease_id)  # held lease_seconds past its last step (a long prefill) or its seal
        self._forget_ended()

    def _seal(self, stream: _Stream, spec: SaveSpec) -> None:
        try:
            if not stream.stored.sealed:  # a layer the forward did not save (save_layer seals once all are in)
                stream.stored.seal()
            # Only the last step's blocks are still being hashed: the checksum follows within that time.
            checksum = _checksum_of(stream.stored, self.settings.kv_read_timeout_seconds)
        except (ValueError, KVTransferError, TimeoutError) as error:
            why = str(error) or f"its checksum was not ready within read_timeout_seconds ({type(error).__name__})"
            self._drop(spec.request_id, f"cannot seal its KV: {why}")
            log.error("pdstack connector: request %s: cannot seal its KV: %s", spec.request_id, why)
            return
        del self._streams[spec.request_id]
        result = {"checksum": checksum, "num_tokens": spec.num_tokens}
        write_json_atomically(result_path(self.settings.worker_dir, spec.request_id), result)
        log.info(
            "pdstack connector: lease %s sealed after %d steps: %d of %d bytes were already served while prefill "
            "computed",
            stream.lease_id,
            stream.steps,
            stream.stored.sent_unsealed,
            stream.stored.nbytes,
        )

    def _drop(self, request_id: str, why: str) -> bool:
        """Abort a request's entry that will never be whole (pulls streaming it end not_found: decode recomputes)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        self.store.abort(stream.lease_id, f"prefill of request {request_id!r}: {why}")
        return True

    def _forget_ended(self) -> None:
        """Streams whose entry the store already let go of (lease run out, replaced): nothing more to add."""
        now = self.store.clock()
        for request_id, stream in list(self._streams.items()):
            if stream.stored.failure is not None or stream.stored.expires_at <= now:
                self._drop(request_id, "its lease ran out before its prompt was complete")

    def shutdown(self) -> None:
        try:
            self.loop.run(self.server.close(), timeout=5.0)
        finally:
            super().shutdown()


def _gather(kv_layer: torch.Tensor, ids: torch.Tensor) -> Callable[[memoryview], None]:
    """Write blocks `ids` of `kv_layer` into a blob's bytes: gathered straight into them on CPU; on GPU gathered on
    the device, then copied to host memory once."""

    def fill(target: memoryview) -> None:
        out = torch.from_numpy(np.frombuffer(target, np.uint8)).view(kv_layer.dtype).view(len(ids), *kv_layer.shape[1:])
        if kv_layer.device.type == "cpu":
            torch.index_select(kv_layer, 0, ids, out=out)
        else:
            with gpu_sync_allowed():
                out.copy_(kv_layer.index_select(0, ids))

    return fill


def _checksum_of(stored: StoredKV, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    with stored.watch() as changed:
        while not stored.checksum:
            stored.check()
            if not changed.wait(deadline - time.monotonic()) and not stored.checksum:
                raise TimeoutError
    return stored.checksum
