"""Decode's worker: checks each request's signed KV params, pulls the blocks its prefix cache lacks in the
background (a range pull, each block verified by its own digest), writes them into its own blocks, reports each
request once its pull ended either way, and acknowledges the pulls that succeeded."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv import KVConnectionPool, KVTransferError, ack, pull
from pdserve.kv import params as signed_params
from pdserve.vllm import fingerprint
from pdserve.vllm.settings import ConnectorSettings
from pdserve.vllm.worker import ConnectorWorker, LoadSpec, log

# vLLM's prefill scheduler adds these to the params after request_finished returned (and signed) them; decode
# reads them for usage reporting only, so they are left out of the signature check.
VLLM_ADDED_FIELDS = ("remote_prefill_cached_tokens",)
REQUIRED_PARAMS = ("remote_request_id", "remote_host", "remote_port", "kv_checksum", "kv_fingerprint", "num_tokens")
# Early dispatch (the gateway signs these before prefill ran): the token count and checksum come in-band instead.
STREAMED_PARAMS = ("remote_request_id", "remote_host", "remote_port", "kv_fingerprint")


@dataclass
class _Pending:
    spec: LoadSpec
    future: concurrent.futures.Future[Any]


class ConsumerWorker(ConnectorWorker):
    """Decode: pulls in the background; writes blocks and reports each request once its pull ended either way."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        super().__init__(settings, vllm_config, kv_caches)
        self._tls = settings.client_tls()
        self.pool: KVConnectionPool = self.loop.run(self._make_pool())
        self._pending: dict[str, _Pending] = {}
        self._ended = threading.Event()  # set when a pull ends, for collect's wait
        self._acks: set[concurrent.futures.Future[Any]] = set()
        self.write_instance("kv_consumer", None, None)
        log.info("pdstack connector: decode worker ready, fingerprint %s", self.fingerprint)

    async def _make_pool(self) -> KVConnectionPool:
        return KVConnectionPool(max_idle_per_peer=4 * self.settings.kv_streams, metrics=self.metrics)

    def start_loads(self, loads: list[LoadSpec]) -> None:
        for spec in loads:
            if spec.request_id in self._pending:
                continue
            future = self.loop.submit(self._fetch(spec))
            future.add_done_callback(lambda _done: self._ended.set())
            self._pending[spec.request_id] = _Pending(spec, future)

    async def _fetch(self, spec: LoadSpec) -> Any:
        params = self._check(spec)
        streamed = bool(params.get("pdstack_streamed"))
        async with asyncio.timeout(self.settings.kv_transfer_timeout_seconds):
            return await pull(
                str(params["remote_host"]),
                self._rank_port(params),
                str(params["remote_request_id"]),
                None if streamed else self._rank_checksum(params),  # streamed: END's, token count checked
                streams=self.settings.streams_for(self._pull_bytes(spec)),
                expected_fingerprint=self.fingerprint,
                first_row=spec.skip_blocks,  # decode's local prefix-cache hit does not cross the wire
                max_bytes=self._prompt_bytes(spec),
                **self._channel_options(params),
            )

    def _pull_bytes(self, spec: LoadSpec) -> int:
        """What the pull will move (known before it starts: prefill's layout is decode's, the fingerprints match)."""
        return self._prompt_bytes(spec) - spec.skip_blocks * sum(self.block_bytes.values())

    def _prompt_bytes(self, spec: LoadSpec) -> int:
        """The KV of the request's whole prompt: the most a manifest for it may announce."""
        return math.ceil(spec.prompt_tokens / self.block_size) * sum(self.block_bytes.values())

    def _rank_port(self, params: dict[str, Any]) -> int:
        """This rank's shard is on the prefill worker of the same TP rank: remote_port + rank (settings.kv_port_of)."""
        return int(params["remote_port"]) + self.settings.tp_rank

    def _rank_checksum(self, params: dict[str, Any]) -> str:
        checksums = params.get("kv_rank_checksums")
        if self.settings.tp_size == 1:
            return str(params["kv_checksum"])
        if not isinstance(checksums, list) or len(checksums) != self.settings.tp_size:
            raise ValueError(
                f"kv_transfer_params.kv_rank_checksums: expected one checksum per TP rank "
                f"({self.settings.tp_size}), got {checksums!r}"
            )
        return str(checksums[self.settings.tp_rank])

    def _channel_options(self, params: dict[str, Any]) -> dict[str, Any]:
        """What every call to the prefill's KV channel (pull, ack) is made with."""
        return {
            "key": self.settings.key,
            "ssl_context": self._tls,
            "server_hostname": self.settings.kv_tls_server_name or str(params["remote_host"]),
            "connect_timeout_s": self.settings.kv_connect_timeout_seconds,
            "read_timeout_s": self.settings.kv_read_timeout_seconds,
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

    def collect(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids whose pull ended; failed ones are in both, as vLLM expects. With `wait_s`,
        when pulls are under way and none has ended, first wait up to that long for one to end."""
        self._wait_for_a_pull(wait_s)
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
                cause = error.cause if isinstance(error, KVTransferError) else _cause(error)
                if not isinstance(error, KVTransferError):  # pull() counts its own failures
                    self.metrics.observe_failure("receiver", cause)
                self.metrics.observe_load_failure(cause)
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

    def _wait_for_a_pull(self, wait_s: float) -> None:
        self._ended.clear()  # before the look: a pull ending after it sets it again
        if wait_s > 0 and self._pending and not any(p.future.done() for p in self._pending.values()):
            self._ended.wait(wait_s)

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
            if raw.size != num_blocks * self.block_bytes[name]:
                raise ValueError(
                    f"layer {name}: {raw.size} bytes of KV, expected {num_blocks * self.block_bytes[name]}"
                )
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
