"""KV sizes of the built-in models against hand arithmetic on their published configs, config.json parity,
parser errors, and cross-checks against figures published in the literature."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdstack.plan.compute import param_counts
from pdstack.plan.kv import kv_footprint
from pdstack.plan.models import (
    ModelError,
    builtin_entries,
    builtin_model,
    load_config_file,
    match_builtin,
    parse_config,
    resolve_model,
)


@pytest.mark.parametrize(
    ("name", "per_token"),
    [
        ("Llama-3-70B", 327_680),  # 80 layers x 8 kv heads x 128 head_dim x 2 (K,V) x 2 B
        ("Llama-3.1-70B", 327_680),  # the same layers; only RoPE scaling and context differ
        ("Llama-3-8B", 131_072),  # 32 x 8 x 128 x 2 x 2
        ("Qwen2.5-72B", 327_680),  # 80 x 8 x 128 x 2 x 2 (use_sliding_window false: all layers full)
        ("Mixtral-8x7B", 131_072),  # 32 x 8 x 128 x 2 x 2 (sliding_window null)
        ("DeepSeek-V3", 70_272),  # MLA: 61 layers x (512 kv_lora_rank + 64 qk_rope_head_dim) x 2 B
        ("Qwen3-Next-80B-A3B", 24_576),  # only the 12 full layers (every 4th of 48) grow: 12 x 2 x 256 x 2 x 2
    ],
)
def test_kv_bytes_per_token_match_hand_computation(name: str, per_token: int) -> None:
    kv = kv_footprint(builtin_model(name))
    assert kv.growing_per_token + kv.sliding_per_token == per_token


def test_qwen3_next_linear_layers_hold_a_fixed_state_per_request() -> None:
    kv = kv_footprint(builtin_model("Qwen3-Next-80B-A3B"))
    # 36 Gated DeltaNet layers x (recurrent 32 v_heads x 128 x 128 = 524,288
    #   + conv (4 - 1) x (2 x 16 x 128 + 32 x 128 = 8,192) = 24,576) elements x 2 B = 36 x 1,097,728
    assert kv.linear_state_per_request == 39_518_208
    # a 1000-token prompt: 1000 x 24,576 + 39,518,208; a 2000-token one adds exactly 1000 x 24,576
    assert kv.bytes_for(1000) == 24_576_000 + 39_518_208
    assert kv.bytes_for(2000) - kv.bytes_for(1000) == 24_576_000


def test_sliding_window_layers_stop_growing_at_the_window() -> None:
    kv = kv_footprint(builtin_model("Mistral-7B-v0.1"))
    assert kv.sliding_per_token == 131_072  # 32 x 8 x 128 x 2 x 2
    assert kv.bytes_for(4096) == 131_072 * 4096 == 536_870_912
    assert kv.bytes_for(10_000) == 536_870_912  # capped at the 4096-token window


def test_fp8_kv_halves_every_figure() -> None:
    assert kv_footprint(builtin_model("DeepSeek-V3"), bytes_per_element=1).mla_per_token == 35_136  # 61 x 576 x 1


@pytest.mark.parametrize("name", list(builtin_entries()))
def test_config_json_file_gives_the_same_model_as_the_builtin(tmp_path: Path, name: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(builtin_entries()[name].config))
    from_file = load_config_file(tmp_path)
    builtin = builtin_model(name)
    assert from_file.layers == builtin.layers
    assert kv_footprint(from_file) == kv_footprint(builtin)
    assert param_counts(from_file) == param_counts(builtin)


def test_layer_types_list_is_honoured() -> None:
    cfg = dict(builtin_entries()["Llama-3-8B"].config, sliding_window=1024)
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 16
    kv = kv_footprint(parse_config(cfg, "gemma-like", "test"))
    assert kv.full_per_token == kv.sliding_per_token == 16 * 8 * 128 * 2 * 2
    assert kv.bytes_for(4096) == 65_536 * 4096 + 65_536 * 1024


def test_unknown_model_type_is_named() -> None:
    with pytest.raises(ModelError, match=r"model_type 'gpt2' is not supported"):
        parse_config({"model_type": "gpt2"}, "x", "cfg.json")


def test_missing_model_type_is_named() -> None:
    with pytest.raises(ModelError, match=r"key 'model_type' is missing"):
        parse_config({"hidden_size": 4096}, "x", "cfg.json")


def test_missing_key_is_named_with_the_model_type() -> None:
    cfg = dict(builtin_entries()["DeepSeek-V3"].config)
    del cfg["kv_lora_rank"]
    with pytest.raises(ModelError, match=r"cfg.json: model_type 'deepseek_v3' needs key 'kv_lora_rank'"):
        parse_config(cfg, "x", "cfg.json")


def test_malformed_config_file_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelError, match=r"not valid JSON: line 1"):
        load_config_file(bad)


@pytest.mark.parametrize(
    ("served", "builtin"),
    [
        ("llama-3.1-70b-instruct", "Llama-3.1-70B"),
        ("meta-llama/Llama-3.3-70B-Instruct", "Llama-3.1-70B"),
        ("meta-llama/Meta-Llama-3-70B-Instruct", "Llama-3-70B"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "Llama-3-8B"),
        ("Qwen/Qwen2.5-72B-Instruct", "Qwen2.5-72B"),
        ("deepseek-ai/DeepSeek-V3", "DeepSeek-V3"),
        ("Qwen3-Next-80B-A3B-Instruct", "Qwen3-Next-80B-A3B"),
        ("pdstack-tiny", None),
    ],
)
def test_served_names_map_to_builtins(served: str, builtin: str | None) -> None:
    assert match_builtin(served) == builtin


def test_unknown_model_name_lists_the_builtins() -> None:
    with pytest.raises(ModelError, match=r"neither a built-in \(Llama-3-70B, "):
        resolve_model("no-such-model")


# ---------------------------------------------------------------------------------------------- literature


def test_isca25_deepseek_insights_table_1() -> None:
    """Zhao et al., "Insights into DeepSeek-V3: Scaling Challenges and Reflections on Hardware for AI
    Architectures", ISCA '25 (arXiv 2505.09343), Table 1, KV cache per token in BF16 (KB = 1000 bytes):
    DeepSeek-V3 (MLA) 70.272 KB, Qwen-2.5 72B (GQA) 327.680 KB, LLaMA-3.1 405B (GQA) 516.096 KB. Exact."""
    assert kv_footprint(builtin_model("DeepSeek-V3")).mla_per_token == 70_272
    assert kv_footprint(builtin_model("Qwen2.5-72B")).full_per_token == 327_680
    llama_405b = {  # meta-llama/Llama-3.1-405B config.json
        "model_type": "llama",
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
    assert kv_footprint(parse_config(llama_405b, "Llama-3.1-405B", "test")).full_per_token == 516_096


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [
        ("DeepSeek-V3", 671, 37),  # DeepSeek-V3 model card: 671B total, 37B activated per token
        ("Mixtral-8x7B", 46.7, 12.9),  # Mistral AI, "Mixtral of experts" (2023): 46.7B total, 12.9B per token
        ("Qwen3-Next-80B-A3B", 80, None),  # Qwen3-Next model card: 80B total (3B activated)
        ("Llama-3-70B", 70.6, None),  # Meta Llama 3 70B: 70.6B parameters
    ],
)
def test_parameter_counts_match_published_totals(name: str, total_b: float, active_b: float | None) -> None:
    counts = param_counts(builtin_model(name))
    assert counts.total / 1e9 == pytest.approx(total_b, rel=0.01)
    if active_b is not None:  # published active counts include the embedding row each token looks up
        assert (counts.active_per_token + counts.embedding) / 1e9 == pytest.approx(active_b, rel=0.02)
