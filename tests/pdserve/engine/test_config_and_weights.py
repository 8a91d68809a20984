from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.engine import (
    CheckpointError,
    Engine,
    MissingTensorError,
    ModelConfig,
    TensorShapeError,
    UnsupportedModelError,
    UnsupportedRopeScalingError,
)
from pdserve.engine.rope import inverse_frequencies
from pdserve.engine.testmodels import f32_to_bf16_bits, make_test_checkpoint, write_safetensors
from pdserve.engine.weights import SafetensorsCheckpoint, bf16_bits_to_f32

BASE = {
    "vocab_size": 10,
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def cfg(**kw: Any) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **kw})


# -- config ----------------------------------------------------------------------------------------------------------


def test_unsupported_model_type_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        cfg(model_type="gpt2")


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", "mystery"])
def test_unsupported_rope_scaling_is_named(rope_type: str) -> None:
    with pytest.raises(UnsupportedRopeScalingError, match=repr(rope_type)):
        cfg(model_type="llama", rope_scaling={"rope_type": rope_type, "factor": 2.0})


def test_rope_scaling_missing_field_is_named() -> None:
    with pytest.raises(UnsupportedRopeScalingError, match="'low_freq_factor'"):
        cfg(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0})


def test_missing_required_field_is_named() -> None:
    raw = {**BASE, "model_type": "llama"}
    del raw["hidden_size"]
    with pytest.raises(CheckpointError, match="'hidden_size'"):
        ModelConfig.from_dict(raw)


def test_other_unsupported_features() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        cfg(model_type="llama", hidden_act="gelu")
    with pytest.raises(UnsupportedRopeScalingError, match="partial_rotary_factor"):
        cfg(model_type="llama", partial_rotary_factor=0.5)
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        cfg(
            model_type="qwen2",
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"],
        )


def test_layer_windows_follow_what_transformers_runs() -> None:
    assert cfg(model_type="llama", sliding_window=4).layer_windows == (None,) * 4
    assert cfg(model_type="mistral", sliding_window=4).layer_windows == (4,) * 4
    assert cfg(model_type="mistral", sliding_window=None).layer_windows == (None,) * 4
    assert cfg(model_type="mixtral").layer_windows == (None,) * 4
    # mistral applies its window to every layer, whatever layer_types says
    assert cfg(model_type="mistral", sliding_window=4, layer_types=["full_attention"] * 4).layer_windows == (4,) * 4
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    assert cfg(model_type="qwen2", use_sliding_window=True, sliding_window=4, layer_types=types).layer_windows == (
        4,
        None,
        None,
        4,
    )
    # qwen2 ignores the window unless use_sliding_window
    assert cfg(model_type="qwen2", sliding_window=4, layer_types=types).layer_windows == (None,) * 4
    # without layer_types, qwen2 slides layers >= max_window_layers
    assert cfg(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2).layer_windows == (
        None,
        None,
        4,
        4,
    )


def test_rope_config_spellings_agree() -> None:
    legacy = cfg(model_type="llama", rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}).rope
    modern = cfg(
        model_type="llama", rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}
    ).rope
    assert legacy == modern
    assert cfg(model_type="mixtral").rope.theta == 1e6  # per-model default
    inv, scale = inverse_frequencies(legacy, 8)
    np.testing.assert_allclose(inv, 1.0 / (500000.0 ** (np.arange(0, 8, 2) / 8)) / 2, rtol=1e-6)
    assert scale == 1.0


def test_moe_and_bias_flags() -> None:
    moe = cfg(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert moe.moe is not None and (moe.moe.num_experts, moe.moe.top_k) == (4, 2)
    assert cfg(model_type="qwen2").qkv_bias and not cfg(model_type="qwen2").o_bias
    biased = cfg(model_type="llama", attention_bias=True, mlp_bias=True)
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        cfg(model_type="mixtral", num_local_experts=2, num_experts_per_tok=3)


# -- weights ---------------------------------------------------------------------------------------------------------


def test_bf16_bits_roundtrip() -> None:
    x = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, 1e-3, 65504.0, np.inf], dtype=np.float32)
    back = bf16_bits_to_f32(f32_to_bf16_bits(x))
    np.testing.assert_allclose(back, x, rtol=2**-8)
    assert back[2] == 1.0 and back[3] == -2.5 and back[4] == 3.140625  # exactly representable values are exact
    # round to nearest even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1
    assert bf16_bits_to_f32(f32_to_bf16_bits(np.array([1 + 2**-8], dtype=np.float32)))[0] == 1.0


def test_half_precision_checkpoints_load_as_rounded_float32(make_checkpoint: Any) -> None:
    ref = SafetensorsCheckpoint(make_checkpoint("dense"))
    for dtype, rtol in (("float16", 2**-10), ("bfloat16", 2**-7)):
        ckpt = SafetensorsCheckpoint(make_checkpoint("dense", dtype))
        assert ckpt.storage_dtype() == dtype
        name = "model.layers.0.self_attn.q_proj.weight"
        got = ckpt.get(name)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref.get(name), rtol=rtol, atol=1e-7)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(path: Path, edit: Any) -> None:
    ckpt = SafetensorsCheckpoint(path)
    tensors = {n: ckpt.get(n) for n in ckpt.names()}
    edit(tensors)
    for f in path.glob("*.safetensors"):
        f.unlink()
    write_safetensors(path / "model.safetensors", tensors, "float32")


def test_missing_tensor_is_named(tmp_path: Path, dense_checkpoint: Path) -> None:
    path = copy_checkpoint(dense_checkpoint, tmp_path / "ck")
    rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight'"):
        Engine.load(path)


def test_wrong_shape_is_named(tmp_path: Path, dense_checkpoint: Path) -> None:
    path = copy_checkpoint(dense_checkpoint, tmp_path / "ck")
    rewrite_tensors(path, lambda t: t.update({"model.norm.weight": np.ones(3, dtype=np.float32)}))
    with pytest.raises(TensorShapeError, match=r"'model\.norm\.weight' has shape \[3\]"):
        Engine.load(path)


def test_missing_files_are_named(tmp_path: Path, dense_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        Engine.load(tmp_path / "nope")
    path = copy_checkpoint(dense_checkpoint, tmp_path / "ck")
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Engine.load(path)
    assert Engine.load(path, load_tokenizer=False).fingerprint == Engine.load(dense_checkpoint).fingerprint
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Engine.load(path, load_tokenizer=False)


def test_unsupported_model_type_from_directory(tmp_path: Path, dense_checkpoint: Path) -> None:
    path = copy_checkpoint(dense_checkpoint, tmp_path / "ck")
    raw = json.loads((path / "config.json").read_text())
    raw["model_type"] = "gemma3"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="'gemma3'"):
        Engine.load(path)


def test_fingerprint(tmp_path: Path, make_checkpoint: Any) -> None:
    dense = make_checkpoint("dense")
    a, b = Engine.load(dense), Engine.load(dense)
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 64 and int(a.fingerprint, 16) >= 0
    # same weights written again from the same seed: same fingerprint; sharding does not matter
    again = make_test_checkpoint("dense", tmp_path / "again")
    assert Engine.load(again).fingerprint == a.fingerprint
    sharded = make_test_checkpoint("dense", tmp_path / "sharded", shards=3)
    assert Engine.load(sharded).fingerprint == a.fingerprint
    # any weight change, other dtype, other seed: different
    edited = copy_checkpoint(dense, tmp_path / "edited")

    def nudge(t: dict[str, np.ndarray]) -> None:
        t["model.layers.2.self_attn.v_proj.weight"][0, 0] += 1e-6

    rewrite_tensors(edited, nudge)
    assert Engine.load(edited).fingerprint != a.fingerprint
    assert Engine.load(make_checkpoint("dense", "bfloat16")).fingerprint != a.fingerprint
    assert Engine.load(make_test_checkpoint("dense", tmp_path / "seed1", seed=1)).fingerprint != a.fingerprint


def test_checkpoints_are_deterministic(tmp_path: Path) -> None:
    for kind in ("dense", "moe", "hybrid"):
        one = make_test_checkpoint(kind, tmp_path / f"{kind}1", dtype="bfloat16")
        two = make_test_checkpoint(kind, tmp_path / f"{kind}2", dtype="bfloat16")
        for f in sorted(p.name for p in one.iterdir()):
            assert (one / f).read_bytes() == (two / f).read_bytes(), f


def test_fused_mixtral_expert_layout_loads_the_same(tmp_path: Path, moe_checkpoint: Path, load_engine: Any) -> None:
    """transformers 5 keeps Mixtral experts fused (gate_up_proj / down_proj); both layouts give the same model."""
    path = copy_checkpoint(moe_checkpoint, tmp_path / "fused")
    engine = load_engine("moe")
    n_layers, n_experts = engine.config.num_layers, engine.config.moe.num_experts

    def fuse(t: dict[str, np.ndarray]) -> None:
        for i in range(n_layers):
            old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
            t[new + "gate.weight"] = t.pop(old + "gate.weight")
            gate_up = [
                np.concatenate([t.pop(f"{old}experts.{e}.w1.weight"), t.pop(f"{old}experts.{e}.w3.weight")])
                for e in range(n_experts)
            ]
            t[new + "experts.gate_up_proj"] = np.stack(gate_up)
            t[new + "experts.down_proj"] = np.stack([t.pop(f"{old}experts.{e}.w2.weight") for e in range(n_experts)])

    rewrite_tensors(path, fuse)
    fused = Engine.load(path)
    ids = engine.tokenizer.encode("the quick server sends a request")
    np.testing.assert_array_equal(
        fused.forward([(ids, fused.new_cache())]), engine.forward([(ids, engine.new_cache())])
    )
