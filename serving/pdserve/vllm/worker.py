"""The connector's worker side: prefill streams each prompt's completed KV blocks, layer by layer as vLLM computes
them, into a lease entry of pdserve's store, which its KV server serves while it is filled; decode pulls the blocks
its prefix cache lacks (a range pull, each block verified by its own digest), and writes them into its own blocks.

Runs in vLLM's (spawned) worker process. The KV channel is asyncio; it runs on one event loop in a daemon thread
so the forward never waits for the network. Tensors are touched only on vLLM's own thread (inside save_kv_layer,
wait_for_save and get_transfer_results), never from the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import math
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from pdserve.kv import KVConnectionPool, KVMeta, KVServer, KVTransferError, LeaseStore, ack, pull
from pdserve.kv import params as signed_params
from pdserve.kv.blob import ArraySpec
from pdserve.kv.entry import StoredKV
from pdserve.vllm import fingerprint
from pdserve.vllm.settings import ConnectorSettings
from pdserve.vllm.stats import RecordingKVMetrics

log = logging.getLogger("vllm.pdstack")  # under vLLM's logger, so its handlers print these lines
# vLLM's prefill scheduler adds these to the params after request_finished returned (and signed) them; decode
# reads them for usage reporting only, so they are left out of the signature check.
VLLM_ADDED_FIELDS = ("remote_prefill_cached_tokens",)
REQUIRED_PARAMS = ("remote_request_id", "remote_host", "remote_port", "kv_checksum", "kv_fingerprint", "num_tokens")
# Early dispatch (the gateway signs these before prefill ran): the token count and checksum come in-band instead.
STREAMED_PARAMS = ("remote_request_id", "remote_host", "remote_port", "kv_fingerprint")
OWNERS_KEPT = 4096


@dataclass(frozen=True)
class SaveSpec:
    """Prefill, one step of a request's prompt: add the blocks this step completes (`block_ids`, the prompt's
    blocks first_block, first_block + 1, ...) to the lease entry `lease_id` (the gateway's pdstack_transfer_id
    under early dispatch, else the request id), opening it on the request's first step (`open`) and sealing it in
    the step that completes the prompt (`seal`). A block half filled at a chunk boundary comes in a later step; the
    prompt's last, partial block comes with the seal."""

    request_id: str
    lease_id: str
    num_tokens: int  # the prompt's
    total_blocks: int  # ceil(num_tokens / block_size): the entry's layout
    computed_tokens: int  # prompt tokens computed once this step ran
    first_block: int
    block_ids: list[int]
    open: bool
    seal: bool


@dataclass(frozen=True)
class LoadSpec:
    """Decode: pull the KV `params` name and write blocks [skip_blocks:] into `block_ids` (local prefix hits skip)."""

    request_id: str
    params: dict[str, Any]
    block_ids: list[int]
    prompt_tokens: int
    skip_blocks: int


def route_channel_logs() -> None:
    """The KV channel's own lines (logger pdserve.kv: refused connections, failed requests) through vLLM's handlers,
    as this module's are; outside the "vllm" logger tree they would reach no handler in vLLM's processes."""
    channel, vllm_logger = logging.getLogger("pdserve.kv"), logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        if handler not in channel.handlers:
            channel.addHandler(handler)
    channel.setLevel(logging.INFO)
    channel.propagate = False


def result_path(run_dir: Path, request_id: str) -> Path:
    """Where the prefill worker leaves a saved request's checksum for the scheduler process (see connector.py)."""
    return run_dir / (hashlib.sha256(request_id.encode()).hexdigest()[:40] + ".json")


def write_json_atomically(path: Path, body: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(body))
    os.replace(temporary, path)


def connector_cpus(wanted: frozenset[int] | None) -> set[int]:
    """The CPUs the connector's threads (KV server, pulls, digests) run on: `wanted` (kv_cpus), else the forward
    thread's own (what they would inherit). Not elsewhere by default: on a CPU host the other cores run the other
    engines' forwards, and threads of one process on two busy cores hand the GIL back and forth; bench/vllm_ttft
    measured early-dispatch TTFT 1.7/1.5/2.1x the bound at 512/2K/8K tokens with the threads on the forward's core,
    6.4/4.2/3.0x on the decode's (quiet 2-core host)."""
    return set(wanted) if wanted else os.sched_getaffinity(0)


def run_on(cpus: set[int]) -> Callable[[], None]:
    """A thread initializer: bind the calling thread to `cpus` (the kernel keeps them within the cgroup's cpuset)."""

    def bind() -> None:
        try:
            os.sched_setaffinity(0, cpus)  # 0: on Linux, the calling thread only
        except OSError as error:  # none of them allowed here: keep the inherited mask
            log.warning("pdstack connector: cannot run on CPUs %s (%s); left where it was", sorted(cpus), error)

    return bind


class _Loop:
    """An asyncio loop in a daemon thread, for the KV server, pulls and acks; it and the threads it starts run on
    `cpus` (see connector_cpus)."""

    def __init__(self, cpus: set[int]) -> None:
        self.loop = asyncio.new_event_loop()
        self._bind = run_on(cpus)
        self._thread = threading.Thread(target=self._run, name="pdstack-kv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._bind()
        self.loop.run_forever()

    def submit(self, coroutine: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Any, timeout: float = 30.0) -> Any:
        return self.submit(coroutine).result(timeout)


class _Worker:
    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        self.settings = settings
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.fields = fingerprint.compute(vllm_config, kv_caches)
        self.fingerprint = fingerprint.digest(self.fields)
        route_channel_logs()
        self.metrics = RecordingKVMetrics()
        self.cpus = connector_cpus(settings.kv_cpus)
        self.loop = _Loop(self.cpus)

    def write_instance(self, role: str, kv_host: str | None, kv_port: int | None) -> None:
        """<run_dir>/instance.json for `pdserve agent --connector-run-dir` (see pdserve.agent.instance): what the
        scheduler needs to pair this instance, written by TP rank 0 of each DP engine (kv_port: that rank's; rank r
        serves on kv_port + r). kv_streaming: it takes the gateway's early-dispatch params (decode) and holds KV
        under their transfer id, waiting pulls for it (prefill); not a prefill of DP > 1, where the gateway cannot
        know which DP engine vLLM gives the request, so which ports to name."""
        s = self.settings
        if s.tp_rank != 0:
            return
        s.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(s.run_dir / "instance.json", {
            "role": role, "fingerprint": self.fingerprint, "fingerprint_fields": self.fields,
            "connector_version": fingerprint.CONNECTOR_VERSION, "kv_host": kv_host, "kv_port": kv_port,
            "kv_streaming": role == "kv_consumer" or not s.data_parallel,
            "tensor_parallel_size": s.tp_size, "data_parallel": s.data_parallel, "data_parallel_index": s.dp_index,
        })  # fmt: skip

    def shutdown(self) -> None:
        self.loop.loop.call_soon_threadsafe(self.loop.loop.stop)


@dataclass
class _Stream:
    """A request whose prompt is being streamed into its lease entry, step by step."""

    request_id: str
    lease_id: str
    stored: StoredKV
    served: list[int]  # bytes the KV server sent from the entry while it was open (see _count_served)
    steps: int = 0


def _count_served(stored: StoredKV) -> list[int]:
    """Count the bytes the KV server takes from `stored` before it is sealed: it asks `ready` for each chunk it is
    about to send. The count is what the seal's log line reports (decode had them while prefill computed)."""
    served = [0]
    ready = stored.ready

    def counting(layer: int, part: int, offset: int, length: int) -> bool:
        found = ready(layer, part, offset, length)
        if found and not stored.sealed:
            served[0] += length
        return found

    stored.ready = counting  # type: ignore[method-assign]
    return served


class ProducerWorker(_Worker):
    """Prefill: streams each prompt's completed blocks out of vLLM layer by layer into a lease entry, which the KV
    server serves while it is filled; seals it when the prompt is complete."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        super().__init__(settings, vllm_config, kv_caches)
        shutil.rmtree(settings.run_dir, ignore_errors=True)
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(
            settings.run_dir / "fingerprint.json", {"fields": self.fields, "digest": self.fingerprint}
        )
        # The store digests each added block on its own threads (BLAKE3), never on vLLM's forward thread.
        self.store = LeaseStore(settings.store_bytes, default_lease_s=settings.lease_seconds, metrics=self.metrics,
                                thread_initializer=run_on(self.cpus))  # fmt: skip
        self.server = KVServer(
            self.store,
            settings.key,
            host=settings.bind_host,
            port=settings.port,
            ssl_context=settings.server_tls(),
            io_timeout_s=settings.read_timeout_seconds,
            metrics=self.metrics,
            open_wait_s=settings.open_wait_seconds,  # early dispatch: decode may ask before prefill opened it
        )
        self.loop.run(self._start())
        self.write_instance("kv_producer", settings.advertise_host, settings.port)
        self.layer_index = {name: index for index, name in enumerate(self.layer_names)}
        self.block_bytes = {name: int(t[0].numel() * t.element_size()) for name, t in kv_caches.items()}
        self._streams: dict[str, _Stream] = {}
        self._step_begun = False
        self._owners: OrderedDict[str, str] = OrderedDict()  # lease id -> the request that opened it
        log.info(
            "pdstack connector: KV server on %s:%d, fingerprint %s, connector threads on CPUs %s",
            settings.bind_host, settings.port, self.fingerprint, sorted(self.cpus),
        )  # fmt: skip

    async def _start(self) -> None:
        await self.server.start()
        self.store.start_reaper()

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, saves: list[SaveSpec]) -> None:
        """Inside the forward, once `layer_name` is computed: add this step's completed blocks of that layer."""
        if not self._step_begun:  # the step's first layer: open the entries of requests starting their prefill
            self._step_begun = True
            for spec in saves:
                if spec.open and spec.request_id not in self._streams:
                    self._open(spec)
        index = self.layer_index[layer_name]
        for spec in saves:
            stream = self._streams.get(spec.request_id)
            if stream is None or not spec.block_ids:
                continue
            ids = torch.tensor(spec.block_ids, dtype=torch.long, device=kv_layer.device)
            with gpu_sync_allowed():
                blocks = kv_layer.index_select(0, ids).cpu().contiguous()
            try:
                stream.stored.add(index, 0, spec.first_block * self.block_bytes[layer_name],
                                  blocks.view(torch.uint8).numpy().reshape(-1))  # fmt: skip
            except ValueError as error:  # sealed or failed under us (lease expired, replaced): it is over
                self._drop(spec.request_id, f"cannot add layer {layer_name}: {error}")

    def _open(self, spec: SaveSpec) -> _Stream | None:
        specs = tuple(
            (ArraySpec(np.dtype(np.uint8).str, (spec.total_blocks, self.block_bytes[name])),
             ArraySpec(np.dtype(np.uint8).str, (0,)))
            for name in self.layer_names
        )  # fmt: skip
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
        stream = _Stream(spec.request_id, spec.lease_id, stored, _count_served(stored))
        self._streams[spec.request_id] = stream
        return stream

    def finish_step(self, saves: list[SaveSpec], aborts: list[str]) -> None:
        """After the forward: log what each request streamed, seal the prompts this step completed, drop the
        entries of requests the scheduler finished before their prompt was complete."""
        self._step_begun = False
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
                "bytes served so far", spec.lease_id, stream.steps, spec.first_block,
                spec.first_block + len(spec.block_ids), spec.total_blocks, spec.computed_tokens, stream.served[0],
            )  # fmt: skip
            if spec.seal:
                self._seal(stream, spec)
            self.store.renew(spec.lease_id)  # held lease_seconds past its last step (a long prefill) or its seal
        self._forget_ended()

    def _seal(self, stream: _Stream, spec: SaveSpec) -> None:
        try:
            stream.stored.seal()
            # Only the last step's blocks are still being hashed: the checksum follows within that time.
            checksum = self.loop.run(_checksum_of(stream.stored), timeout=self.settings.read_timeout_seconds)
        except (ValueError, KVTransferError, TimeoutError) as error:
            why = str(error) or f"its checksum was not ready within read_timeout_seconds ({type(error).__name__})"
            self._drop(spec.request_id, f"cannot seal its KV: {why}")
            log.error("pdstack connector: request %s: cannot seal its KV: %s", spec.request_id, why)
            return
        del self._streams[spec.request_id]
        write_json_atomically(
            result_path(self.settings.run_dir, spec.request_id), {"checksum": checksum, "num_tokens": spec.num_tokens}
        )
        log.info(
            "pdstack connector: lease %s sealed after %d steps: %d of %d bytes were already served while prefill "
            "computed", stream.lease_id, stream.steps, stream.served[0], stream.stored.nbytes,
        )  # fmt: skip

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


async def _checksum_of(stored: StoredKV) -> str:
    with stored.watch() as changed:
        while not stored.checksum:
            stored.check()
            await changed.wait(1.0)
    return stored.checksum


@dataclass
class _Pending:
    spec: LoadSpec
    future: concurrent.futures.Future[Any]


class ConsumerWorker(_Worker):
    """Decode: pulls in the background; writes blocks and reports each request once its pull ended either way."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        super().__init__(settings, vllm_config, kv_caches)
        self._tls = settings.client_tls()
        self.pool: KVConnectionPool = self.loop.run(self._make_pool())
        self._pending: dict[str, _Pending] = {}
        self._acks: set[concurrent.futures.Future[Any]] = set()
        self.write_instance("kv_consumer", None, None)
        log.info("pdstack connector: decode worker ready, fingerprint %s", self.fingerprint)

    async def _make_pool(self) -> KVConnectionPool:
        return KVConnectionPool(max_idle_per_peer=4 * self.settings.streams, metrics=self.metrics)

    def start_loads(self, loads: list[LoadSpec]) -> None:
        for spec in loads:
            if spec.request_id in self._pending:
                continue
            self._pending[spec.request_id] = _Pending(spec, self.loop.submit(self._fetch(spec)))

    async def _fetch(self, spec: LoadSpec) -> Any:
        params = self._check(spec)
        streamed = bool(params.get("pdstack_streamed"))
        async with asyncio.timeout(self.settings.transfer_timeout_seconds):
            return await pull(
                str(params["remote_host"]),
                self._rank_port(params),
                str(params["remote_request_id"]),
                None if streamed else self._rank_checksum(params),  # streamed: END's, token count checked
                streams=self.settings.streams,
                expected_fingerprint=self.fingerprint,
                first_row=spec.skip_blocks,  # decode's local prefix-cache hit does not cross the wire
                **self._channel_options(params),
            )

    def _rank_port(self, params: dict[str, Any]) -> int:
        """This rank's shard is on the prefill worker of the same TP rank: remote_port + rank (settings.kv_port_of)."""
        return int(params["remote_port"]) + self.settings.tp_rank

    def _rank_checksum(self, params: dict[str, Any]) -> str:
        checksums = params.get("kv_rank_checksums")
        if self.settings.tp_size == 1:
            return str(params["kv_checksum"])
        if not isinstance(checksums, list) or len(checksums) != self.settings.tp_size:
            raise ValueError(f"kv_transfer_params.kv_rank_checksums: expected one checksum per TP rank "
                             f"({self.settings.tp_size}), got {checksums!r}")  # fmt: skip
        return str(checksums[self.settings.tp_rank])

    def _channel_options(self, params: dict[str, Any]) -> dict[str, Any]:
        """What every call to the prefill's KV channel (pull, ack) is made with."""
        return {
            "key": self.settings.key,
            "ssl_context": self._tls,
            "server_hostname": self.settings.tls_server_name or str(params["remote_host"]),
            "connect_timeout_s": self.settings.connect_timeout_seconds,
            "read_timeout_s": self.settings.read_timeout_seconds,
            "metrics": self.metrics,
            "pool": self.pool,
        }

    def _check(self, spec: LoadSpec) -> dict[str, Any]:
        """Refuse params before any connection: unsigned or edited, incomplete, another prompt, another layout."""
        signed = {name: value for name, value in spec.params.items() if name not in VLLM_ADDED_FIELDS}
        params = signed_params.verify(self.settings.params_key, signed)
        streamed = bool(params.get("pdstack_streamed"))
        required = STREAMED_PARAMS if streamed else REQUIRED_PARAMS
        missing = [name for name in required if params.get(name) in (None, "")]
        if missing:
            raise ValueError(f"kv_transfer_params.{missing[0]}: missing")
        remote_tp = params.get("remote_tp_size", self.settings.tp_size)  # early dispatch: the digest covers TP
        if remote_tp != self.settings.tp_size:
            raise fingerprint.FingerprintMismatch("tensor_parallel_size", remote_tp, self.settings.tp_size)
        if streamed:
            # The gateway signs only the digest prefill registered; the manifest's token count is checked on arrival.
            if params["kv_fingerprint"] != self.fingerprint:
                raise fingerprint.FingerprintMismatch("digest", params["kv_fingerprint"], self.fingerprint)
            return params
        fingerprint.compare(params.get("kv_fingerprint_fields"), self.fields)
        if params["kv_fingerprint"] != self.fingerprint:
            raise ValueError("kv_transfer_params.kv_fingerprint: does not match its fields")
        if int(params["num_tokens"]) != spec.prompt_tokens:
            raise ValueError(
                f"kv_transfer_params.num_tokens: the KV is for {params['num_tokens']} prompt tokens, this "
                f"request's prompt has {spec.prompt_tokens}"
            )
        return params

    def collect(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids whose pull ended; failed ones are in both, as vLLM expects."""
        finished: set[str] = set()
        failed: set[str] = set()
        for request_id, pending in list(self._pending.items()):
            if not pending.future.done():
                continue
            del self._pending[request_id]
            finished.add(request_id)
            try:
                self._write(pending.spec, pending.future.result())
            except Exception as error:  # every failure, whatever its cause, goes to vLLM's kv_load_failure_policy
                failed.add(request_id)
                if not isinstance(error, KVTransferError):  # pull() counts its own failures
                    self.metrics.observe_failure("receiver", _cause(error))
                log.warning(
                    "pdstack connector: KV load for request %s failed, left to kv_load_failure_policy: %s",
                    request_id,
                    _describe(error),
                )
                continue
            log.info(
                "pdstack connector: loaded the KV of %d prompt tokens for request %s from %s:%s (%s)",
                pending.spec.prompt_tokens,
                request_id,
                pending.spec.params.get("remote_host"),
                self._rank_port(pending.spec.params),
                pending.spec.params.get("remote_request_id"),
            )
            self._acknowledge(pending.spec.params)
        return finished, failed

    def _write(self, spec: LoadSpec, blob: Any) -> None:
        num_blocks = math.ceil(spec.prompt_tokens / self.block_size)
        if blob.meta.token_count != spec.prompt_tokens or len(blob.layers) != len(self.layer_names):
            raise ValueError(
                f"KV blob holds {blob.meta.token_count} tokens in {len(blob.layers)} layers, expected "
                f"{spec.prompt_tokens} tokens in {len(self.layer_names)}"
            )
        targets = spec.block_ids[spec.skip_blocks : num_blocks]
        if len(spec.block_ids) < num_blocks:
            raise ValueError(f"decode allocated {len(spec.block_ids)} blocks, the prompt needs {num_blocks}")
        for name, (raw, _empty) in zip(self.layer_names, blob.layers, strict=True):
            kv_layer = self.kv_caches[name]
            block_bytes = kv_layer[0].numel() * kv_layer.element_size()
            if raw.size != num_blocks * block_bytes:
                raise ValueError(f"layer {name}: {raw.size} bytes of KV, expected {num_blocks * block_bytes}")
            blocks = torch.from_numpy(raw).view(kv_layer.dtype).reshape(num_blocks, *kv_layer.shape[1:])
            ids = torch.tensor(targets, dtype=torch.long, device=kv_layer.device)
            kv_layer.index_copy_(0, ids, blocks[spec.skip_blocks :].to(kv_layer.device))

    def _acknowledge(self, params: dict[str, Any]) -> None:
        async def send() -> None:
            try:
                await ack(
                    str(params["remote_host"]),
                    self._rank_port(params),
                    str(params["remote_request_id"]),
                    **self._channel_options(params),
                )
            except KVTransferError as error:  # the lease then expires on prefill instead
                log.info("pdstack connector: ack of %s failed: %s", params["remote_request_id"], error)

        future = self.loop.submit(send())
        self._acks.add(future)
        future.add_done_callback(self._acks.discard)

    def shutdown(self) -> None:
        try:
            self.loop.run(self.pool.close(), timeout=5.0)
        finally:
            super().shutdown()


def _cause(error: BaseException) -> str:
    if isinstance(error, signed_params.ParamsSignatureError):
        return "auth"
    if isinstance(error, fingerprint.FingerprintMismatch):
        return "fingerprint"
    if isinstance(error, TimeoutError):
        return "timeout"
    return "protocol"


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timeout: the transfer took longer than transfer_timeout_seconds"
    return str(error) or type(error).__name__
