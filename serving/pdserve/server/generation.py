"""From a validated request to generated tokens: tokenise, check limits, admit, obtain the KV, run, collect.

The role decides where a sequence's KV comes from: computed here (colocated, and decode without remote params),
computed here and exported under a lease (prefill with `do_remote_decode`), or pulled from prefill (decode with
`do_remote_prefill`; if that fails, recomputed here or refused, per `kv_load_failure_policy`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast, get_args

from pdserve.engine import ChatTemplateError, Engine, KVCache, TokenOutput
from pdserve.kv import StoredKV
from pdserve.kv.errors import Cause
from pdserve.server import faults
from pdserve.server.batching import Admission, BatchScheduler, Reservation, Sequence
from pdserve.server.kvlink import DecodeImporter, KVLoadFailure, PrefillExporter, kv_memory_per_request
from pdserve.server.metrics import ServerMetrics
from pdserve.server.schemas import ChatCompletionRequest, CompletionRequest, RequestError, _GenerationRequest
from pdserve.server.settings import FailurePolicy, ServerSettings

log = logging.getLogger(__name__)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Generation:
    """One admitted request: iterate `outputs()` for its tokens; `close()` always runs (via outputs' finally)."""

    request_id: str
    sequence: Sequence
    reservation: Reservation
    service: GenerationService
    remote_request_id: str | None = None
    exported: dict[str, StoredKV] = field(default_factory=dict)
    recomputed: bool = False
    closed: bool = False
    kv_transfer_stats: dict[str, Any] | None = None  # decode only: where the prompt's KV came from, bytes, seconds

    @property
    def prompt_tokens(self) -> int:
        return len(self.sequence.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.sequence.state.token_ids)

    @property
    def text(self) -> str:
        return self.sequence.state.text

    @property
    def finish_reason(self) -> str | None:
        return self.sequence.state.finish_reason

    async def outputs(self) -> AsyncIterator[TokenOutput]:
        try:
            while True:
                event = await self.sequence.outputs.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finished:
                    return
        finally:
            self.close()

    def kv_transfer_params(self) -> dict[str, Any] | None:
        """Prefill's answer to `do_remote_decode`: only when the request ended at its length cap (as vLLM)."""
        stored = self.exported.get("stored")
        exporter = self.service.exporter
        if stored is None or exporter is None or self.remote_request_id is None or self.finish_reason != "length":
            return None
        return exporter.response_params(self.remote_request_id, stored, self.prompt_tokens)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sequence.aborted = not self.sequence.state.finished
        self.reservation.release()
        exporter = self.service.exporter
        if exporter is not None and self.remote_request_id is not None and self.kv_transfer_params() is None:
            exporter.release(self.remote_request_id)  # nobody will pull it


class GenerationService:
    def __init__(
        self,
        settings: ServerSettings,
        engine: Engine,
        scheduler: BatchScheduler,
        admission: Admission,
        metrics: ServerMetrics,
        *,
        exporter: PrefillExporter | None,
        importer: DecodeImporter | None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.scheduler = scheduler
        self.admission = admission
        self.metrics = metrics
        self.exporter = exporter
        self.importer = importer
        self.kv_failure_action = "recompute" if settings.kv_load_failure_policy is FailurePolicy.RECOMPUTE else "fail"
        if importer is not None:  # every cause's series from 0: a judge's increase() then counts its first failure
            for cause in get_args(Cause):
                metrics.kv_load_failures.labels(cause, self.kv_failure_action)
        self.max_model_len = min(
            settings.max_model_len or engine.config.max_position_embeddings, engine.config.max_position_embeddings
        )

    # -- prompts -----------------------------------------------------------------------------------------------------

    def completion_prompt(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in cast(list[int], prompt)]  # the schema unwrapped a one-prompt batch
            vocab = self.engine.config.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt: token id {bad} is outside the vocabulary 0..{vocab - 1}", param="prompt")
        if not ids:
            raise RequestError("prompt: the prompt is empty", param="prompt")
        return ids

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        try:
            return self.engine.chat_prompt([m.as_template_input() for m in request.messages])
        except ChatTemplateError as error:
            raise RequestError(f"messages: {error}", param="messages") from error

    def max_tokens(self, request: _GenerationRequest, prompt_tokens: int, default: int | None) -> int:
        limit = self.max_model_len
        if prompt_tokens >= limit:
            raise RequestError(
                f"prompt: {prompt_tokens} tokens, but this model's context length is {limit} tokens "
                "(prompt plus at least one generated token must fit)",
                param="prompt",
            )
        room = limit - prompt_tokens
        if request.max_tokens is not None and request.max_tokens > room:
            raise RequestError(
                f"max_tokens: {request.max_tokens} requested, but the prompt takes {prompt_tokens} of "
                f"the model's {limit}-token context, leaving {room}",
                param="max_tokens",
            )
        wanted = request.max_tokens if request.max_tokens is not None else default
        granted = min(wanted, room) if wanted is not None else room
        if (request.min_tokens or 0) > granted:
            raise RequestError(
                f"min_tokens: {request.min_tokens} is more than max_tokens ({granted})", param="min_tokens"
            )
        return granted

    # -- running -----------------------------------------------------------------------------------------------------

    async def start(
        self, request: _GenerationRequest, prompt_ids: list[int], max_tokens: int, request_id: str
    ) -> Generation:
        params = request.kv_transfer_params
        remote_decode = params is not None and params.do_remote_decode
        remote_prefill = params is not None and params.do_remote_prefill
        self._check_role(remote_decode, remote_prefill, request.stream)
        transfer = None
        if remote_prefill:
            assert self.importer is not None and params is not None
            transfer = self.importer.check_params(params, len(prompt_ids))
        sampling = faults.sampling(self.settings, request.sampling_params(max_tokens))
        # Everything from here to the hand-over may fail; the reservation is given back whatever raises.
        with self.admission.reserve(kv_memory_per_request(self.engine, len(prompt_ids) + max_tokens)) as reservation:
            if transfer is not None:
                assert self.importer is not None
                self.importer.claim(transfer)
            started = time.perf_counter()
            cache, recomputed = await self._initial_cache(request, len(prompt_ids), request_id)
            kv_stats = self._kv_transfer_stats(remote_prefill, recomputed, cache, time.perf_counter() - started)
            state = self.engine.new_request(prompt_ids, sampling)
            state.max_total_tokens = self.max_model_len
            sequence = Sequence(request_id, prompt_ids, state, cache)
            generation = Generation(
                request_id, sequence, reservation, self, recomputed=recomputed, kv_transfer_stats=kv_stats
            )
            if remote_decode:
                assert self.exporter is not None
                generation.remote_request_id = f"{self.settings.engine_id}-{uuid.uuid4().hex}"
                sequence.export = self.exporter.hook(generation.remote_request_id, generation.exported)
            reservation.sequence = sequence
            self.scheduler.add(sequence)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        log.info(
            "request admitted",
            extra={
                "request_id": request_id,
                "prompt_tokens": len(prompt_ids),
                "max_tokens": max_tokens,
                "remote_prefill": remote_prefill,
                "remote_decode": remote_decode,
                "kv_request_id": generation.remote_request_id,
                "recomputed": recomputed,
            },
        )
        return generation

    def _check_role(self, remote_decode: bool, remote_prefill: bool, stream: bool) -> None:
        role = self.settings.role.value
        if remote_decode and self.exporter is None:
            raise RequestError(
                f"kv_transfer_params.do_remote_decode: this {role} server does not export KV "
                "(send it to a prefill server)",
                param="kv_transfer_params.do_remote_decode",
            )
        if remote_decode and stream:
            raise RequestError("stream: must be false with kv_transfer_params.do_remote_decode", param="stream")
        if remote_prefill and self.importer is None:
            raise RequestError(
                f"kv_transfer_params.do_remote_prefill: this {role} server does not import KV "
                "(send it to a decode server)",
                param="kv_transfer_params.do_remote_prefill",
            )

    def _kv_transfer_stats(
        self, remote_prefill: bool, recomputed: bool, cache: KVCache, seconds: float
    ) -> dict[str, Any] | None:
        """What decode tells the gateway about this request's KV (relayed to the gateway's metrics)."""
        if self.importer is None:
            return None
        if not remote_prefill:
            return {"source": "local", "bytes": 0, "seconds": 0.0}
        if recomputed:
            return {"source": "recompute", "bytes": 0, "seconds": round(seconds, 6)}
        return {"source": "remote", "bytes": cache.nbytes(), "seconds": round(seconds, 6)}

    async def _initial_cache(
        self, request: _GenerationRequest, prompt_tokens: int, request_id: str
    ) -> tuple[KVCache, bool]:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill:
            return self.engine.new_cache(), False
        assert self.importer is not None
        try:
            return await self.importer.load(params, prompt_tokens), False
        except KVLoadFailure as failure:
            action = self.kv_failure_action
            self.metrics.kv_load_failures.labels(failure.cause, action).inc()
            log.warning(
                "remote KV unusable",
                extra={"request_id": request_id, "cause": failure.cause, "action": action, "detail": failure.message},
            )
            if action == "fail":
                raise RequestError(
                    f"remote KV could not be loaded ({failure}); kv_load_failure_policy is fail",
                    param="kv_transfer_params",
                    status=502,
                    kind="kv_load_failure",
                ) from failure
            return self.engine.new_cache(), True
