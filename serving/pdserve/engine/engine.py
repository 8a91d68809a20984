"""The engine facade the servers use: load a checkpoint, run batched steps, generate.

Typical use by a server::

    engine = Engine.load("/models/tiny")
    cache = engine.new_cache()
    logits = engine.forward([(prompt_chunk_ids, cache)])            # prefill, possibly in several chunks
    ...
    logits = engine.forward([(ids_a, cache_a), (ids_b, cache_b)])  # any mix of prefill chunks and decode tokens

The engine is not thread-safe: one step at a time per Engine object.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .config import ModelConfig
from .errors import CheckpointError, EngineError, KVCacheError
from .kv_cache import KV_DTYPE_NAME, KV_LAYOUT_VERSION, KVCache, KVCacheSpec
from .model import StepItem, Transformer
from .sampling import FinishReason, RequestState, SamplingParams, TokenOutput
from .tokenizer import Tokenizer
from .weights import SafetensorsCheckpoint, load_model_weights

ENGINE_MAJOR_VERSION = 1

F32 = npt.NDArray[np.float32]
TokenIds = Sequence[int] | npt.NDArray[np.integer]


@dataclass(frozen=True)
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


def compute_fingerprint(weights_sha256: str, dtype: str, config: ModelConfig) -> str:
    """Hex sha256 of what must match for two engines to exchange KV caches and tokens."""
    payload = json.dumps(
        {
            "engine_major": ENGINE_MAJOR_VERSION,
            "kv_layout": KV_LAYOUT_VERSION,
            "kv_dtype": KV_DTYPE_NAME,
            "weights_sha256": weights_sha256,
            "dtype": dtype,
            "config": json.loads(config.canonical_json()),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


class Engine:
    def __init__(
        self,
        config: ModelConfig,
        model: Transformer,
        tokenizer: Tokenizer | None,
        *,
        fingerprint: str,
        dtype: str,
        weights_sha256: str,
        path: Path | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.model = model
        self._tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.dtype = dtype  # storage dtype of the checkpoint: float32, float16, bfloat16 (computation is float32)
        self.weights_sha256 = weights_sha256
        self.path = path
        self.eos_token_ids = tuple(eos_token_ids)
        self.kv_spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, config.layer_windows)

    @classmethod
    def load(cls, path: str | Path, load_tokenizer: bool = True) -> Engine:
        """Load a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {path}")
        config = ModelConfig.from_file(path / "config.json")
        ckpt = SafetensorsCheckpoint(path)
        weights = load_model_weights(ckpt, config)
        weights_sha = ckpt.weights_checksum()
        dtype = ckpt.storage_dtype()
        tokenizer = Tokenizer.from_directory(path) if load_tokenizer else None
        eos = list(config.eos_token_ids)
        generation_config = path / "generation_config.json"
        if generation_config.is_file():
            gen_eos = json.loads(generation_config.read_text(encoding="utf-8")).get("eos_token_id")
            if gen_eos is not None:
                eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        if tokenizer is not None and (tok_eos := tokenizer.special_token_id("eos_token")) is not None:
            eos.append(tok_eos)
        eos_ids = tuple(dict.fromkeys(int(e) for e in eos))
        return cls(
            config,
            Transformer(config, weights),
            tokenizer,
            fingerprint=compute_fingerprint(weights_sha, dtype, config),
            dtype=dtype,
            weights_sha256=weights_sha,
            path=path,
            eos_token_ids=eos_ids,
        )

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineError("this engine was loaded without a tokenizer")
        return self._tokenizer

    # -- caches and steps ------------------------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        return KVCache(self.kv_spec)

    def cache_from_layers(self, layers: Sequence[tuple[npt.ArrayLike, npt.ArrayLike]], position: int) -> KVCache:
        return KVCache.from_layers(self.kv_spec, layers, position)

    def _items(self, batch: Sequence[tuple[TokenIds, KVCache]]) -> list[StepItem]:
        if not batch:
            raise EngineError("forward needs at least one (token_ids, cache) item")
        items: list[StepItem] = []
        seen: set[int] = set()
        vocab = self.config.vocab_size
        for index, (ids, cache) in enumerate(batch):
            arr = np.asarray(ids, dtype=np.int64).reshape(-1)
            if arr.size == 0:
                raise EngineError(f"batch item {index} has no tokens")
            if arr.min() < 0 or arr.max() >= vocab:
                raise EngineError(f"batch item {index} has a token id outside 0..{vocab - 1}")
            if not isinstance(cache, KVCache) or cache.spec != self.kv_spec:
                raise KVCacheError(f"batch item {index}: the KV cache does not belong to this model")
            if id(cache) in seen:
                raise KVCacheError(f"batch item {index}: the same KV cache appears twice in one step")
            seen.add(id(cache))
            items.append(StepItem(arr, cache))
        return items

    def forward(self, batch: Sequence[tuple[TokenIds, KVCache]]) -> F32:
        """One batched step. Each item is (new token ids, cache): a prefill chunk or a decode token. Appends the new
        tokens' K/V to each cache and returns each item's last-position logits, shape [len(batch), vocab]."""
        return np.stack(self.model.forward(self._items(batch)))

    def forward_all(self, batch: Sequence[tuple[TokenIds, KVCache]]) -> list[F32]:
        """As ``forward`` but returns the logits of every new token, one [t_i, vocab] array per item."""
        return self.model.forward(self._items(batch), all_logits=True)

    def prefill(
        self, prompt_ids: TokenIds, cache: KVCache | None = None, chunk_size: int | None = None
    ) -> tuple[F32, KVCache]:
        """Feed a prompt (in chunks of ``chunk_size`` if given); returns (last logits [vocab], cache)."""
        cache = self.new_cache() if cache is None else cache
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise EngineError("prompt is empty")
        step = chunk_size if chunk_size else ids.size
        logits: F32 | None = None
        for start in range(0, ids.size, step):
            logits = self.forward([(ids[start : start + step], cache)])[0]
        assert logits is not None
        return logits, cache

    # -- generation ------------------------------------------------------------------------------------------------

    def new_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> RequestState:
        return RequestState(
            self.tokenizer, list(prompt_ids), params, self.eos_token_ids, self.config.max_position_embeddings
        )

    def generate_stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, chunk_size: int | None = None
    ) -> Iterator[TokenOutput]:
        """Colocated reference path: prefill then decode one sequence, yielding every token's output."""
        request = self.new_request(prompt_ids, params)
        logits, cache = self.prefill(prompt_ids, chunk_size=chunk_size)
        while True:
            out = request.step(logits)
            yield out
            if out.finished:
                return
            logits = self.forward([([out.token_id], cache)])[0]

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        outputs = list(self.generate_stream(prompt_ids, params))
        last = outputs[-1]
        assert last.finish_reason is not None
        return GenerationResult(
            prompt_token_ids=list(prompt_ids),
            token_ids=[o.token_id for o in outputs],
            text="".join(o.text for o in outputs),
            finish_reason=last.finish_reason,
        )

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of a chat rendered with the checkpoint's chat template (generation prompt appended)."""
        return self.tokenizer.encode_chat(messages, **kwargs)
