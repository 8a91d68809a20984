"""Decode throughput of the numpy engine against batch size.

Builds a seeded Llama checkpoint somewhat larger than the test ones (by default hidden 512, 8 layers, 8 query /
2 KV heads, intermediate 1536, vocab 8192), prefills ``batch`` sequences, then times ``--steps`` batched decode
steps (one token per sequence per step, greedy) for each batch size and prints tokens/s and the ratio to batch 1.

    python bench/decode_batching.py [--batches 1 4 16 64] [--steps 16] [--prompt-len 64] [--repeats 3]

Set OPENBLAS_NUM_THREADS (e.g. 1) in the environment to pin BLAS threads; on a busy 2-core machine one thread
is both faster and steadier.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.engine import Engine
from pdserve.engine.testmodels import make_test_checkpoint

BENCH_MODEL = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
}


def measure(engine: Engine, batch: int, steps: int, prompt_len: int, repeats: int = 3) -> tuple[float, float]:
    """Return (seconds per decode step, decode tokens per second) at this batch size: the best of ``repeats``
    runs of ``steps`` steps each (best-of damps the noise of a shared machine)."""
    rng = np.random.default_rng(batch)
    caches = []
    tokens = []
    for _ in range(batch):
        prompt = rng.integers(3, engine.config.vocab_size, size=prompt_len)
        logits, cache = engine.prefill(prompt)
        caches.append(cache)
        tokens.append(int(np.argmax(logits)))
    logits = engine.forward([([t], c) for t, c in zip(tokens, caches, strict=True)])  # warm-up step
    tokens = [int(t) for t in np.argmax(logits, axis=-1)]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            logits = engine.forward([([t], c) for t, c in zip(tokens, caches, strict=True)])
            tokens = [int(t) for t in np.argmax(logits, axis=-1)]
        best = min(best, time.perf_counter() - start)
    return best / steps, batch * steps / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch size; the best one counts")
    parser.add_argument("--checkpoint", type=Path, help="use this checkpoint instead of building the bench model")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        path = args.checkpoint or make_test_checkpoint("dense", Path(tmp) / "bench", overrides=BENCH_MODEL)
        engine = Engine.load(path)
        cfg = engine.config
        params = sum(a.size for a in _arrays(engine))
        print(
            f"model: {cfg.model_type} hidden={cfg.hidden_size} layers={cfg.num_layers} heads={cfg.num_heads}/"
            f"{cfg.num_kv_heads} intermediate={cfg.intermediate_size} vocab={cfg.vocab_size} "
            f"params={params / 1e6:.1f}M (float32 compute)"
        )
        print(
            f"prompt={args.prompt_len} tokens, best of {args.repeats} x {args.steps} decode steps, "
            f"cores={os.cpu_count()}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
            f"numpy {np.__version__}"
        )
        print(f"{'batch':>5}  {'ms/step':>8}  {'tokens/s':>9}  {'vs batch 1':>10}")
        base: float | None = None
        for batch in args.batches:
            per_step, tps = measure(engine, batch, args.steps, args.prompt_len, args.repeats)
            base = base if base is not None else tps
            print(f"{batch:>5}  {per_step * 1e3:>8.1f}  {tps:>9.1f}  {tps / base:>9.2f}x")
    return 0


def _arrays(engine: Engine) -> list[np.ndarray]:
    w = engine.model.weights
    out: list[np.ndarray] = [w.embed, w.final_norm]
    if not engine.config.tie_word_embeddings:
        out.append(w.lm_head)
    for layer in w.layers:
        out += [layer.input_norm, layer.post_attention_norm, layer.qkv, layer.o]
        out += [a for a in vars(layer.mlp).values() if isinstance(a, np.ndarray)]
    return out


if __name__ == "__main__":
    sys.exit(main())
