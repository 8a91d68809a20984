"""The connector's worker side: prefill streams each prompt's completed KV blocks, layer by layer as vLLM computes
them, into a lease entry of pdserve's store, which its KV server serves while it is filled; decode pulls the blocks
its prefix cache lacks (a range pull, each block verified by its own digest), and writes them into its own blocks.

Runs in vLLM's (spawned) worker process. The KV channel is asyncio; it runs on one event loop in a daemon thread
so the forward never waits for the network. Tensors are touched only on vLLM's own thread (inside save_kv_layer,
wait_for_save and get_transfer_results), never from the loop thread.
This module holds what both sides share (the step specs, the loop thread, CPU binding, the instance file);
pdserve.vllm.producer is prefill's side, pdserve.vllm.consumer decode's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.vllm import fingerprint
from pdserve.vllm.settings import ConnectorSettings
from pdserve.vllm.stats import RecordingKVMetrics

log = logging.getLogger("vllm.pdstack")  # under vLLM's logger, so its handlers print these lines


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


class ConnectorWorker:
    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        self.settings = settings
        self.kv_caches = kv_caches
        self.layer_names = list(kv_caches)
        self.block_bytes = {name: int(t[0].numel() * t.element_size()) for name, t in kv_caches.items()}
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
        s.worker_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomically(
            s.worker_dir / "instance.json",
            {
                "role": role,
                "fingerprint": self.fingerprint,
                "fingerprint_fields": self.fields,
                "connector_version": fingerprint.CONNECTOR_VERSION,
                "kv_host": kv_host,
                "kv_port": kv_port,
                "kv_streaming": role == "kv_consumer" or not s.data_parallel,
                "tensor_parallel_size": s.tp_size,
                "data_parallel": s.data_parallel,
                "data_parallel_index": s.dp_index,
            },
        )

    def shutdown(self) -> None:
        self.loop.loop.call_soon_threadsafe(self.loop.loop.stop)
