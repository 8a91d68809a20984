"""PdstackConnector: a vLLM v1 KV connector that moves KV between a vLLM prefill and a vLLM decode over pdstack's
KV channel (pdserve.kv: framed TCP over N streams, CRC-32C per frame, a BLAKE3 digest per KV block, mutual HMAC,
optional TLS, leases), the same protocol and code pdserve's own servers speak.

Load it with vLLM's own flag:

    --kv-transfer-config '{"kv_connector": "PdstackConnector", "kv_connector_module_path": "pdserve.vllm.connector",
                           "kv_role": "kv_producer" | "kv_consumer", "kv_load_failure_policy": "recompute" | "fail",
                           "kv_connector_extra_config": {"kv_key_file": "...", "kv_port": 14600, ...}}'

(keys in pdserve.vllm.settings). The flow is vLLM's disaggregated-prefill proxy flow, with vLLM's field names:

- Prefill (kv_producer) gets a request with kv_transfer_params {"do_remote_decode": true}. On its first prefill
  step the worker opens a lease entry in pdserve's LeaseStore (served by a KVServer in the worker process); in
  every step, save_kv_layer copies the blocks that step completed of each layer to host memory (`.cpu()`, so the
  same code serves CUDA tensors) and adds them to the entry as the layer is computed, so a pull already waiting
  streams them while prefill computes the next layers and chunks; the step that completes the prompt seals it.
  The scheduler side tells the worker, each step, the prompt tokens computed and which blocks became complete: with
  chunked prefill a block half filled at a chunk's end waits for the next step, the prompt's last partial block
  comes with the prompt. The store digests each block (BLAKE3) on its own threads, off the forward thread; the
  sealing step waits only for its own blocks' digests, to hand the checksum over. A request that ends before its
  prompt is complete (aborted, client gone) has its entry aborted in the next step (pulls end not_found, decode
  recomputes); a preempted one keeps its entry and resumes after the blocks already added (their KV does not
  change). request_finished returns do_remote_prefill,
  remote_engine_id, remote_request_id, remote_host, remote_port, remote_block_ids, plus kv_checksum, num_tokens
  and the KV fingerprint, signed with pdserve.kv.params under the params key derived from the KV channel key.
- Both report the KV channel's metrics (bytes, seconds, goodput, failures by cause, auth refusals, leases)
  through vLLM's connector-stats path into the API server's /metrics, under pdserve's names (see stats.py).
- Decode (kv_consumer) gets those params. get_num_new_matched_tokens claims the prompt tokens it lacks as an
  async load; the worker verifies the signature and the fingerprint (naming the field that differs) BEFORE any
  connection, pulls in a background event loop only the blocks it lacks (a range pull: a local prefix-cache hit
  does not cross the wire), verifies each frame's CRC-32C and each block's digest against the blob checksum, writes
  them, reports finished_recving and acknowledges so prefill frees the
  lease. Any failure is reported in failed_recving (and finished_recving), so vLLM's kv_load_failure_policy
  recomputes or fails the request; every request the worker is given is reported exactly once, so the scheduler
  never sees an unknown id.

Why copy out instead of delaying the free of vLLM's blocks: prefill's blocks are its scarcest resource (they bound
its batch), and a cross-datacenter pull takes one RTT plus the transfer, sometimes a lease timeout when decode
dies. Held in vLLM's blocks, a slow or lost decode would throttle prefill and every path (abort, preemption,
restart) would have to report finished_sending exactly once. Copied out, prefill frees its blocks at the end of the
step that computed them, the lease store bounds what is held in bytes and in time (lease_seconds) on its own, and
the KV server reads host memory instead of racing the engine for device memory. The cost is one device-to-host copy
per layer, which a GPU does at tens of GB/s (far above the network), and host RAM for what is in flight.

The scheduler process and the worker process are separate: the scheduler-side request_finished must return the
blob checksum the worker computed in the same step. The worker leaves it in a small file under
`<run_dir>/<engine_id>-<port>/` (written before the step's output returns, so before request_finished runs);
request_finished reads and removes it. vLLM's worker-to-scheduler metadata arrives only after request_finished in
the same step, too late.

Early dispatch (the gateway sends prefill and decode the request at once, see README): prefill holds the KV under
the request's `pdstack_transfer_id` instead of its vLLM request id, and its KV server lets a pull wait
`open_wait_seconds` for an id not held yet; decode accepts the gateway-signed params without kv_checksum and
num_tokens (the checksum comes at the end of the authenticated pull, the token count in its manifest).

Tensor and data parallelism: each TP rank holds its own KV heads of every layer, so each prefill worker runs its
own KV server and lease store for its shard, on the port pdserve.vllm.settings.kv_port_of gives it (base + DP index
x TP + rank); request_finished (once per DP engine: each has its own scheduler) names its engine's rank-0 port,
remote_tp_size and each rank's checksum, and decode rank r pulls from remote_port + r. Both ends need the same
tensor_parallel_size (the fingerprint covers it, and decode refuses params naming remote_tp_size when they differ):
prefill TP 8 -> decode TP 1 would need decode to gather each block's heads from eight prefill ranks, which this
version does not do. A prefill of DP > 1 registers kv_streaming false: under early dispatch the gateway names the
KV endpoint before vLLM picks the DP engine, so it could name the wrong one.

Limits of this version: equal TP on both ends, pipeline and context parallelism 1, one KV cache group (no hybrid or
sliding-window models).

About 400 lines, kept whole: vLLM loads one class for both sides (kv_connector_module_path), and its worker half
only hands each call to pdserve.vllm.producer or .consumer; the rest is its scheduler half and these notes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.request import RequestStatus

from pdserve.kv import params as signed_params
from pdserve.vllm.consumer import ConsumerWorker
from pdserve.vllm.producer import ProducerWorker
from pdserve.vllm.settings import ConnectorSettings
from pdserve.vllm.stats import PdstackPromMetrics, PdstackStats
from pdserve.vllm.worker import LoadSpec, SaveSpec, result_path

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.pdstack")  # under vLLM's logger, so its handlers print these lines
TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
DP_ENGINE = re.compile(r"_dp\d+$")
KEPT_FILES = ("fingerprint.json", "instance.json")  # the worker's, for this process and the agent; never swept
# A decode step that computes nothing (every request it holds waits for its KV) waits up to this long for a pull to
# end before it reports: vLLM's engine loops without pause while a request waits for remote KV, each empty step a
# round trip between EngineCore and worker that takes the core (and the worker's GIL) from the pulls' threads and
# the other processes beside it. A pull that ends wakes the wait at once; a request arriving meanwhile is scheduled
# at most this much later.
IDLE_WAIT_S = 0.01


@dataclass
class PdstackConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, pickled each step."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # requests finished before their prompt was complete
    idle: bool = False  # the step computes no token (decode has only requests waiting for their KV)


@dataclass
class _Prefilling:
    """Scheduler side: a do_remote_decode request whose prompt is being streamed, and how far."""

    request: Request
    sent_blocks: int = 0  # the prompt's blocks already given to the worker (complete when computed)
    opened: bool = False


def _refuse_unsupported_parallelism(parallel: Any) -> None:
    """Pipeline parallelism splits the layers over workers, context parallelism the tokens: each worker would hold
    a part of a block the other end expects whole. Tensor and data parallelism are supported."""
    for name in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) != 1:
            raise ValueError(f"{name}: PdstackConnector supports 1 only, got {getattr(parallel, name)}")


def _one_of_several_dp_engines(parallel: Any, engine_id: str) -> bool:
    """Whether this engine is one DP engine of several. For a dense model vLLM runs each DP engine as an
    independent DP 1 (ParallelConfig.reconfigure_for_independent_dp_rank: data_parallel_size 1, only
    data_parallel_index keeps the rank), so engine 0 of a DP-2 dense instance looks like DP 1 but for the
    `_dp<rank>` vLLM appends to every DP engine's kv_transfer_config.engine_id (v1/engine/core.py)."""
    return (
        int(parallel.data_parallel_size) > 1
        or int(parallel.data_parallel_index) > 0
        or bool(DP_ENGINE.search(engine_id))
    )


def lease_id(request: Request) -> str:
    """What prefill holds a request's KV under: the gateway's pdstack_transfer_id (early dispatch: decode was told
    it before prefill ran) when it is one (32 hex characters, never a vLLM request id), else vLLM's request id."""
    transfer = (request.kv_transfer_params or {}).get("pdstack_transfer_id")
    if isinstance(transfer, str) and TRANSFER_ID.fullmatch(transfer):
        return transfer
    return request.request_id


class PdstackConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"kv_role: PdstackConnector supports kv_producer and kv_consumer, not {transfer.kv_role}")
        parallel = vllm_config.parallel_config
        _refuse_unsupported_parallelism(parallel)
        self.producer = transfer.kv_role == "kv_producer"
        self.engine_id = str(transfer.engine_id)  # vLLM appends _dp<index> per DP engine
        self.settings = ConnectorSettings.of(
            dict(transfer.kv_connector_extra_config or {}),
            producer=self.producer,
            engine_id=self.engine_id,
            tp_size=int(parallel.tensor_parallel_size),
            dp_index=int(parallel.data_parallel_index),
            data_parallel=_one_of_several_dp_engines(parallel, self.engine_id),
        )
        self.block_size = int(vllm_config.cache_config.block_size)
        # Scheduler side.
        self._to_save: dict[str, _Prefilling] = {}
        self._sealed: set[str] = set()  # prompts streamed whole; a request preempted later is not streamed again
        self._aborts: list[str] = []
        self._to_load: list[LoadSpec] = []
        self._local_hits: dict[str, int] = {}
        self._fingerprint: dict[str, Any] | None = None
        self._next_sweep = 0.0
        # Worker side.
        self._worker: ProducerWorker | ConsumerWorker | None = None

    # ---- worker side ------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Each TP rank holds its own heads of every layer: its worker serves (prefill) or pulls (decode) that shard
        only, on its own port (settings.kv_port_of)."""
        worker_class = ProducerWorker if self.producer else ConsumerWorker
        rank = get_tensor_model_parallel_rank() if self.settings.tp_size > 1 else 0
        self._worker = worker_class(self.settings.for_rank(rank), self._vllm_config, kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PdstackConnectorMetadata)
        if metadata.loads:
            assert isinstance(self._worker, ConsumerWorker), "KV loads sent to a kv_producer"
            self._worker.start_loads(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request waits in WAITING_FOR_REMOTE_KVS until its blocks are written

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PdstackConnectorMetadata)
        if metadata.saves and isinstance(self._worker, ProducerWorker):
            self._worker.save_layer(layer_name, kv_layer, metadata.saves)

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PdstackConnectorMetadata)
        if (metadata.saves or metadata.aborts) and isinstance(self._worker, ProducerWorker):
            self._worker.finish_step(metadata.saves, metadata.aborts)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if not isinstance(self._worker, ConsumerWorker):
            return KVConnectorTransferResults()
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(metadata, PdstackConnectorMetadata) and metadata.idle
        finished, failed = self._worker.collect(wait_s=IDLE_WAIT_S if idle else 0.0)
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = PdstackStats(data=self._worker.metrics.take())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PdstackStats(data=dict(data)) if data is not None else PdstackStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return PdstackPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    # ---- scheduler side ---------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if self.producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = len(request.prompt_token_ids or []) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if self.producer:
            rid = request.request_id
            if params.get("do_remote_decode") and rid not in self._to_save and rid not in self._sealed:
                self._to_save[rid] = _Prefilling(request)  # a preempted request resumes where its stream was
            return
        local_hit = self._local_hits.pop(request.request_id, 0)
        if not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        assert self._kv_cache_manager is not None
        block_ids = list(self._kv_cache_manager.get_block_ids(request.request_id)[0])
        prompt_tokens = len(request.prompt_token_ids or [])
        self._to_load.append(
            LoadSpec(request.request_id, dict(params), block_ids, prompt_tokens, local_hit // self.block_size)
        )
        params["do_remote_prefill"] = False  # loaded once: a preempted and resumed request recomputes instead

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        metadata = PdstackConnectorMetadata(
            loads=self._to_load, aborts=self._aborts, idle=not scheduler_output.total_num_scheduled_tokens
        )
        self._to_load, self._aborts = [], []
        for request_id, prefilling in list(self._to_save.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if not scheduled:
                continue
            spec = self._save_spec(prefilling, scheduled)
            metadata.saves.append(spec)
            if spec.seal:
                del self._to_save[request_id]
                self._sealed.add(request_id)
        return metadata

    def _save_spec(self, prefilling: _Prefilling, scheduled: int) -> SaveSpec:
        """What the worker adds this step: the blocks that become complete (a block half filled at this chunk's
        end waits for the next; the prompt's last block is complete with the prompt). A request preempted and
        rescheduled recomputes from its start: blocks it already sent are not sent again (their KV is the same)."""
        request = prefilling.request
        prompt = request.num_prompt_tokens
        computed = min(request.num_computed_tokens + scheduled, prompt)  # num_computed_tokens: before this step
        total = math.ceil(prompt / self.block_size)
        complete = total if computed >= prompt else computed // self.block_size
        assert self._kv_cache_manager is not None
        block_ids = self._kv_cache_manager.get_block_ids(request.request_id)[0]
        first = prefilling.sent_blocks
        spec = SaveSpec(
            request.request_id,
            lease_id(request),
            prompt,
            total,
            computed,
            first,
            list(block_ids[first:complete]),
            open=not prefilling.opened,
            seal=computed >= prompt,
        )
        prefilling.sent_blocks = max(first, complete)
        prefilling.opened = True
        return spec

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        prefilling = self._to_save.pop(request.request_id, None)
        if prefilling is not None and prefilling.opened:
            self._aborts.append(request.request_id)  # the worker aborts its unsealed entry next step
        self._sealed.discard(request.request_id)
        self._local_hits.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not self.producer or not params or not params.get("do_remote_decode"):
            return False, None
        saved = self._take_result(request.request_id)
        if saved is None or request.status not in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            # Nothing held for decode (aborted, or the store refused it): decode computes the prompt itself.
            return False, None
        fingerprint = self._own_fingerprint()
        if fingerprint is None:
            return False, None
        returned = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": lease_id(request),
            "remote_host": self.settings.advertise_host,
            "remote_port": self.settings.port,  # this DP engine's TP rank 0; rank r serves on remote_port + r
            "remote_tp_size": self.settings.tp_size,
            "remote_block_ids": list(block_ids),
            "num_tokens": saved[0]["num_tokens"],
            "kv_checksum": saved[0]["checksum"],
            "kv_fingerprint": fingerprint["digest"],
            "kv_fingerprint_fields": fingerprint["fields"],
        }
        if len(saved) > 1:
            returned["kv_rank_checksums"] = [rank["checksum"] for rank in saved]
        return False, signed_params.sign(self.settings.params_key, returned)

    def _rank_dirs(self) -> list[Path]:
        return [self.settings.for_rank(rank).worker_dir for rank in range(self.settings.tp_size)]

    def _take_result(self, request_id: str) -> list[dict[str, Any]] | None:
        """Each TP rank's checksum and token count (vLLM aggregates every rank's step output before the scheduler
        sees it, so all ranks wrote theirs); None unless every rank holds the request's KV."""
        self._sweep()
        results: list[dict[str, Any]] | None = []
        for run_dir in self._rank_dirs():
            path = result_path(run_dir, request_id)
            try:
                body = json.loads(path.read_text())
            except (OSError, ValueError):
                results = None
                continue
            path.unlink(missing_ok=True)
            if results is not None:
                results.append(dict(body))
        return results

    def _sweep(self) -> None:
        """Remove results nobody will read: a request aborted while the step saving it ran finished before its file
        was written. Its lease expires on its own; its file would stay. Once per lease period, older than two."""
        now = time.time()
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.settings.kv_lease_seconds
        for path in (path for run_dir in self._rank_dirs() for path in run_dir.glob("*.json")):
            with contextlib.suppress(OSError):
                if path.name not in KEPT_FILES and path.stat().st_mtime < now - 2 * self.settings.kv_lease_seconds:
                    path.unlink()

    def _own_fingerprint(self) -> dict[str, Any] | None:
        """The worker's fingerprint (it knows the attention backend and the KV tensors; this process does not)."""
        if self._fingerprint is None:
            try:
                self._fingerprint = json.loads((self.settings.worker_dir / "fingerprint.json").read_text())
            except (OSError, ValueError) as error:
                log.error("pdstack connector: the worker's fingerprint is unreadable (%s); no KV offered", error)
        return self._fingerprint
