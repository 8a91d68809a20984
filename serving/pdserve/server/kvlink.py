"""Both ends of the KV channel as the servers use them: prefill exports KV under a lease, decode imports it.

The KV shipped is that of prompt[:-1] (see batching.py for why); `num_tokens` in kv_transfer_params is the prompt's
token count, so the blob holds num_tokens - 1 tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdserve.common.kv_tls import RotatingContext, kv_client_context, kv_server_context
from pdserve.common.tracing import tracer
from pdserve.engine import Engine, EngineError, KVCache
from pdserve.kv import (
    KVBlob,
    KVConnectionPool,
    KVMeta,
    KVServer,
    KVTransferError,
    LeaseStore,
    SecretKey,
    StoredKV,
    ack,
    pull,
)
from pdserve.kv import params as signed_params
from pdserve.kv.errors import Cause
from pdserve.server.batching import ExportHook, Sequence
from pdserve.server.metrics import ServerMetrics
from pdserve.server.schemas import KVTransferParams, RequestError
from pdserve.server.settings import ServerSettings

log = logging.getLogger(__name__)
TRANSFERRED_IDS_KEPT = 65536
ACK_GRACE_SECONDS = 2.0


def server_tls(settings: ServerSettings) -> RotatingContext | None:
    """Prefill's KV listener: TLS with kv_tls_cert/key, and mutual TLS once kv_tls_ca is set too; rotated from the
    files like the HTTP listener's (tls_reload_seconds)."""
    if settings.kv_tls_cert is None or settings.kv_tls_key is None:
        return None
    return kv_server_context(settings.kv_tls_cert, settings.kv_tls_key, settings.kv_tls_ca, settings.tls_reload_seconds)


def client_tls(settings: ServerSettings) -> RotatingContext | None:
    """Decode's pulls: prefill must chain to kv_tls_ca; decode presents kv_tls_cert when it has one."""
    if settings.kv_tls_ca is None:
        return None
    return kv_client_context(settings.kv_tls_ca, settings.kv_tls_cert, settings.kv_tls_key, settings.tls_reload_seconds)


def kv_memory_per_request(engine: Engine, total_tokens: int) -> int:
    """Bytes a sequence's KV can grow to (sliding layers stop at their window)."""
    spec = engine.kv_spec
    per_token = 2 * spec.num_kv_heads * spec.head_dim * 4
    return sum(spec.layer_tokens(layer, total_tokens) for layer in range(spec.num_layers)) * per_token


class PrefillExporter:
    """Prefill role: a LeaseStore served by a KVServer; sequences hand their KV to it just before their first token."""

    def __init__(self, settings: ServerSettings, engine: Engine, key: SecretKey, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.key = key
        self.store = LeaseStore(settings.kv_store_bytes, settings.kv_lease_seconds, metrics=metrics.kv)
        self.server = KVServer(
            self.store,
            key,
            host=settings.kv_listen_host,
            port=settings.kv_port,
            ssl_context=server_tls(settings),
            io_timeout_s=settings.kv_read_timeout_seconds,
            limits=settings,
            metrics=metrics.kv,
        )

    async def start(self) -> None:
        await self.server.start()
        self.store.start_reaper()

    async def close(self) -> None:
        await self.store.stop_reaper()
        await self.server.close()

    def hook(self, remote_request_id: str, holder: dict[str, StoredKV]) -> ExportHook:
        def export(sequence: Sequence) -> None:
            layers = [(np.array(k), np.array(v)) for k, v in sequence.cache.layers()]
            meta = KVMeta(remote_request_id, sequence.cache.position, self.engine.fingerprint)
            holder["stored"] = self.store.put(remote_request_id, layers, meta)

        return export

    def response_params(self, remote_request_id: str, stored: StoredKV, num_tokens: int) -> dict[str, object]:
        """What prefill returns for decode, signed: decode pulls only from where a prefill server said to."""
        return signed_params.sign(
            signed_params.derive_params_key(self.key.material),
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.settings.engine_id,
                "remote_request_id": remote_request_id,
                "remote_host": self.settings.advertised_host,
                "remote_port": self.server.port,
                "remote_block_ids": [],  # pdserve addresses KV by remote_request_id, not by blocks
                "kv_fingerprint": self.engine.fingerprint,
                "num_tokens": num_tokens,
                "kv_checksum": stored.checksum,
            },
        )

    def release(self, remote_request_id: str) -> None:
        self.store.ack(remote_request_id)


@dataclass
class KVLoadFailure(Exception):
    cause: Cause
    message: str

    def __str__(self) -> str:
        return f"{self.cause}: {self.message}"


class DecodeImporter:
    """Decode role: pulls and verifies remote KV, acknowledges it, and remembers what was transferred.

    Pulls and acks share one connection pool for the importer's lifetime, so repeated pulls from a prefill server
    skip the connect and auth round trips; `close` ends it.
    """

    def __init__(self, settings: ServerSettings, engine: Engine, key: SecretKey, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.key = key
        self.metrics = metrics
        self._tls = client_tls(settings)
        self._transferred: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._acks: set[asyncio.Task[None]] = set()
        # Room for the streams of a few concurrent pulls from one prefill server.
        self.pool = KVConnectionPool(max_idle_per_peer=4 * settings.kv_streams, metrics=metrics.kv)

    async def close(self) -> None:
        """Give acks under way a moment to finish, then close the pool (an ack still running fails; the lease it
        would have freed expires instead)."""
        if self._acks:
            await asyncio.wait(self._acks, timeout=ACK_GRACE_SECONDS)
        await self.pool.close()
        await asyncio.gather(*self._acks, return_exceptions=True)

    def check_params(self, params: KVTransferParams, prompt_tokens: int) -> tuple[str, str]:
        """Refuse params not signed by a prefill server (before anything connects anywhere), incomplete, for another
        prompt, or already transferred; the transfer is claimed by `claim` once the request is admitted."""
        missing = params.missing_remote_fields()
        if missing:
            raise RequestError(f"kv_transfer_params: missing {', '.join(missing)}", param="kv_transfer_params")
        try:
            signed = params.model_dump(mode="json", exclude_unset=True)
            signed_params.verify(signed_params.derive_params_key(self.key.material), signed)
        except signed_params.ParamsSignatureError as error:
            raise RequestError(str(error), param=error.param) from None
        if params.num_tokens != prompt_tokens:
            raise RequestError(
                f"kv_transfer_params.num_tokens: the KV is for {params.num_tokens} prompt tokens, this request's "
                f"prompt has {prompt_tokens}",
                param="kv_transfer_params.num_tokens",
            )
        transfer = (str(params.remote_engine_id), str(params.remote_request_id))
        self._refuse_if_transferred(transfer)
        return transfer

    def claim(self, transfer: tuple[str, str]) -> None:
        """Mark a transfer as done (a request transfers at most once), refusing one already claimed."""
        self._refuse_if_transferred(transfer)
        self._transferred[transfer] = None
        while len(self._transferred) > TRANSFERRED_IDS_KEPT:
            self._transferred.popitem(last=False)

    def _refuse_if_transferred(self, transfer: tuple[str, str]) -> None:
        if transfer in self._transferred:
            raise RequestError(
                f"kv_transfer_params: KV of request {transfer[1]!r} was already transferred (a request "
                "transfers at most once)",
                param="kv_transfer_params.remote_request_id",
                status=409,
            )

    async def load(self, params: KVTransferParams, prompt_tokens: int) -> KVCache:
        """The KV of prompt[:-1], pulled and verified; raises KVLoadFailure naming the cause."""
        assert params.remote_host and params.remote_port and params.remote_request_id and params.kv_checksum
        if params.kv_fingerprint != self.engine.fingerprint:
            raise KVLoadFailure(
                "fingerprint",
                f"prefill's KV fingerprint {params.kv_fingerprint} differs from this "
                f"decoder's {self.engine.fingerprint} (different model, dtype or engine version)",
            )
        with tracer().start_as_current_span(
            "kv pull",
            kind=SpanKind.CLIENT,
            attributes={
                "server.address": params.remote_host,
                "server.port": params.remote_port,
                "pdserve.kv.remote_request_id": params.remote_request_id,
                "pdserve.kv.streams": self.settings.kv_streams,
            },
        ) as span:
            started = time.perf_counter()
            try:
                blob = await self._pull(params)
            except KVTransferError as error:
                span.set_status(Status(StatusCode.ERROR, error.message))
                span.set_attribute("pdserve.kv.cause", str(error.cause))
                raise KVLoadFailure(error.cause, error.message) from error
            seconds = time.perf_counter() - started
            span.set_attributes(
                {
                    "pdserve.kv.bytes": blob.nbytes,
                    "pdserve.kv.tokens": blob.meta.token_count,
                    "pdserve.kv.goodput_bytes_per_second": blob.nbytes / seconds if seconds else 0.0,
                }
            )
        if blob.meta.token_count != prompt_tokens - 1:
            message = f"the KV holds {blob.meta.token_count} tokens, expected {prompt_tokens - 1}"
            raise KVLoadFailure("protocol", message)
        try:
            cache = self.engine.cache_from_layers(blob.layers, blob.meta.token_count)
        except EngineError as error:
            raise KVLoadFailure("protocol", f"the KV does not fit this model: {error}") from error
        self._acknowledge(params.remote_host, params.remote_port, params.remote_request_id)
        return cache

    async def _pull(self, params: KVTransferParams) -> KVBlob:
        """The pull, within kv_transfer_timeout_seconds (each frame within kv_read_timeout_seconds)."""
        deadline = self.settings.kv_transfer_timeout_seconds
        try:
            async with asyncio.timeout(deadline):
                return await pull(
                    params.remote_host,
                    params.remote_port,
                    params.remote_request_id,
                    params.kv_checksum,
                    streams=self.settings.kv_streams,
                    expected_fingerprint=self.engine.fingerprint,
                    **self._channel_options(),
                )
        except TimeoutError:
            message = f"the pull took longer than kv_transfer_timeout_seconds ({deadline:g} s)"
            raise KVTransferError("timeout", message) from None

    def _channel_options(self) -> dict[str, Any]:
        """What every call to a prefill's KV channel (pull, ack) is made with."""
        return {
            "key": self.key,
            "ssl_context": self._tls,
            "server_hostname": self.settings.kv_tls_server_name,
            "connect_timeout_s": self.settings.kv_connect_timeout_seconds,
            "read_timeout_s": self.settings.kv_read_timeout_seconds,
            "metrics": self.metrics.kv,
            "pool": self.pool,
        }

    def _acknowledge(self, host: str, port: int, request_id: str) -> None:
        async def send() -> None:
            try:
                await ack(
                    host,
                    port,
                    request_id,
                    **self._channel_options(),
                )
            except KVTransferError as error:  # the lease then simply expires
                log.warning("kv ack failed", extra={"kv_request_id": request_id, "cause": error.cause})

        task = asyncio.get_running_loop().create_task(send())
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)
