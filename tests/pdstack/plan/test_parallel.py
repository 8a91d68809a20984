"""The planner under vLLM parallelism: per-GPU weights and KV, the decode batch that fits, expert placement, and
settings that cannot fit, against hand computation from the models' published configs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.plan.catalog import load_catalog
from pdstack.plan.hardware import engine_replica
from pdstack.plan.link import LinkSpec
from pdstack.plan.models import builtin_model
from pdstack.plan.parallel import Parallelism, engine_memory, memory_misfits, shape_misfits
from pdstack.plan.planner import PlanInputs, Slo, make_plan
from pdstack.plan.timing import Efficiency, decode_step_seconds, engine_step_seconds, model_costs
from pdstack.plan.workload import from_distribution
from tests.support import STACKS
from tests.support.stackedit import edit

GPUS = load_catalog().gpus

# Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json): hidden 8192, intermediate 28672, 80 layers, 64 heads,
# 8 KV heads, head_dim 8192 / 64 = 128, vocab 128256, untied head.
LLAMA_ATTENTION = 8192 * 64 * 128 + 2 * 8192 * 8 * 128 + 64 * 128 * 8192  # q, k and v, o: 150,994,944
LLAMA_MLP = 3 * 8192 * 28672  # gate, up, down: 704,643,072
LLAMA_EMBEDDING = 128256 * 8192  # 1,050,673,152, and the head as much again
LLAMA_PARAMS = 80 * (LLAMA_ATTENTION + LLAMA_MLP) + 2 * LLAMA_EMBEDDING  # 70,552,387,584

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): hidden 7168, 61 layers of MLA (q_lora_rank 1536,
# kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, 128 heads); layers 0-2 dense (intermediate 18432), the
# other 58 MoE: 256 routed experts and 1 shared of moe_intermediate 2048, top-8; vocab 129280; FP8 checkpoint.
DS_EXPERT = 3 * 7168 * 2048  # one expert's gate, up, down: 44,040,192
DS_ROUTED = 58 * 256 * DS_EXPERT  # 653,908,770,816
DS_MLA = (7168 * 1536 + 1536 * 128 * 192) + (7168 * 576 + 512 * 128 * 256) + 128 * 128 * 7168  # 187,105,280
DS_SHARED = 61 * DS_MLA + 3 * 3 * 7168 * 18432 + 58 * DS_EXPERT + 58 * 7168 * 256 + 2 * 129280 * 7168
DS_REPLICATED = 58 * 7168 * 256 + 61 * 7168 * (1536 + 512 + 64)  # router + q_a_proj + kv_a_proj: 1,029,898,240


def test_published_parameter_counts_by_hand() -> None:
    assert LLAMA_PARAMS == 70_552_387_584
    assert DS_ROUTED + DS_SHARED == 671_025_397_760  # the model card's 671B
    assert DS_SHARED == 17_116_626_944


def test_llama_3_70b_tp8_on_8_h100() -> None:
    mem = engine_memory(builtin_model("Llama-3-70B"), "H100", GPUS["H100"], Parallelism(tensor_parallel_size=8))
    weights = LLAMA_PARAMS * 2 / 8  # bf16, every matrix (embedding and head too) split 8 ways
    assert weights == 17_638_096_896
    assert mem.weight_bytes == weights and mem.expert_weight_bytes == 0 and mem.experts_per_gpu is None
    assert mem.budget_bytes == pytest.approx(0.92 * 80e9)  # vLLM's default gpu_memory_utilization
    room = 73_600_000_000 - 17_638_096_896
    assert mem.kv_room_bytes == pytest.approx(room) == 55_961_903_104
    assert mem.kv_heads_per_gpu == 1  # 8 KV heads / TP 8
    assert mem.kv_bytes_per_token == 80 * 2 * 1 * 128 * 2 == 40_960  # an eighth of the model's 327,680 B
    # 8192 tokens = 512 blocks of 16; 8192 x 40,960 B = 335,544,320 B per sequence per GPU
    assert mem.sequence_bytes(8192) == 335_544_320
    assert mem.max_batch(8192) == room // 335_544_320 == 166
    assert mem.tokens_per_group() == room // (40_960 * 16) * 16 == 1_366_256
    assert memory_misfits(mem, 8192) == [] and shape_misfits(builtin_model("Llama-3-70B"), mem.parallelism) == []


def test_kv_heads_are_replicated_when_fewer_than_tp() -> None:
    # Qwen3-Next: 2 KV heads; at TP 8 each GPU keeps one (replicated 4 times), not a quarter of one.
    mem = engine_memory(builtin_model("Qwen3-Next-80B-A3B"), "H100", GPUS["H100"], Parallelism(8))
    assert mem.kv_heads_per_gpu == 1
    assert mem.kv_bytes_per_token == 12 * 2 * 1 * 256 * 2 == 12_288  # 12 full layers, head_dim 256
    # Gated DeltaNet state split by TP: 36 layers x (32 x 128 x 128 + 3 x 8192) x 2 B / 8
    assert mem.state_bytes_per_sequence == 36 * (32 * 128 * 128 + 3 * 8192) * 2 / 8 == 4_939_776


def test_deepseek_v3_with_expert_parallelism_across_a_decode_pool() -> None:
    # 4 x p5e.48xlarge = 32 H200s: TP 1 x DP 32 (attention data-parallel), EP 32, FP8 weights, bf16 MLA KV.
    par = Parallelism(tensor_parallel_size=1, data_parallel_size=32, enable_expert_parallel=True)
    model = builtin_model("DeepSeek-V3")
    mem = engine_memory(model, "H200", GPUS["H200"], par, weight_bytes=1.0, block_size=64)
    assert par.ep_size == 32 and engine_replica("p5e.48xlarge", par.gpus).nodes == 4
    assert mem.experts_per_gpu == 256 // 32 == 8
    assert mem.expert_weight_bytes == 58 * 8 * DS_EXPERT == 20_434_649_088
    assert mem.shared_weight_bytes == DS_SHARED  # TP 1: every GPU holds all of attention, dense MLPs, shared expert
    room = 0.92 * 141e9 - (DS_SHARED + 58 * 8 * DS_EXPERT)
    assert mem.kv_room_bytes == pytest.approx(room) and room == pytest.approx(92_168_723_968)
    assert mem.kv_heads_per_gpu is None
    assert mem.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # MLA's latent, whole on every GPU
    per_sequence = 8192 * 70_272  # 128 blocks of 64: 575,668,224 B
    assert mem.sequence_bytes(8192) == per_sequence
    assert mem.sequences_per_group(8192) == int(room // per_sequence) == 160
    assert mem.max_batch(8192) == 32 * 160 == 5120  # every DP group holds its own sequences


def test_eplb_redundant_experts_take_memory_from_the_kv() -> None:
    model = builtin_model("DeepSeek-V3")
    par = Parallelism(1, 32, True, num_redundant_experts=32)
    mem = engine_memory(model, "H200", GPUS["H200"], par, weight_bytes=1.0, block_size=64)
    assert mem.experts_per_gpu == (256 + 32) // 32 == 9
    room = 0.92 * 141e9 - (DS_SHARED + 58 * 9 * DS_EXPERT)  # 89.61 GB
    assert mem.max_batch(8192) == 32 * int(room // (8192 * 70_272)) == 32 * 155
    # An uneven split: vLLM gives the first (experts % EP) GPUs one more; the busiest GPU is what must fit.
    uneven = engine_memory(model, "H200", GPUS["H200"], Parallelism(1, 24, True), weight_bytes=1.0)
    assert uneven.experts_per_gpu == 11  # ceil(256 / 24)


def test_without_expert_parallelism_experts_are_cut_across_tp_and_dp() -> None:
    # DeepSeek-V3 on one p5e at TP 8: shared weights split 8 ways except the replicated router and MLA down-
    # projections; each routed expert cut 8 ways.
    mem = engine_memory(builtin_model("DeepSeek-V3"), "H200", GPUS["H200"], Parallelism(8), weight_bytes=1.0)
    assert mem.shared_weight_bytes == (DS_SHARED - DS_REPLICATED) / 8 + DS_REPLICATED == 3_040_739_328
    assert mem.expert_weight_bytes == DS_ROUTED / 8 == 81_738_596_352
    assert mem.experts_per_gpu is None


def test_settings_that_cannot_fit_are_named() -> None:
    model = builtin_model("DeepSeek-V3")
    on_h100 = engine_memory(model, "H100", GPUS["H100"], Parallelism(8, 1, True), weight_bytes=1.0)
    # 3.04 GB + 653.9 GB / 8 = 84.78 GB per H100, over 0.92 x 80 GB = 73.6 GB
    [misfit] = memory_misfits(on_h100, 4096)
    assert misfit.setting == "data_parallel_size"
    assert misfit.reason == (
        "weights need 84.8 GB per H100 at TP 8 x DP 1 with EP, more than gpu_memory_utilization "
        "0.92 x 80 GB = 73.6 GB: spread the experts over more GPUs"
    )
    llama = builtin_model("Llama-3.1-70B")
    tp2 = engine_memory(llama, "H100", GPUS["H100"], Parallelism(2))
    # 141.1 GB / 2 = 70.55 GB of weights leaves 3.05 GB; 32768 tokens x 80 x 2 x 4 heads x 128 x 2 B = 5.37 GB
    [context] = memory_misfits(tp2, 32768)
    assert context.setting == "max_model_len" and "needs 5.37 GB of KV per GPU" in context.reason
    assert "leaves 3.05 GB" in context.reason and memory_misfits(tp2, 8192) == []  # 1.34 GB fits
    [tp1] = memory_misfits(engine_memory(llama, "H100", GPUS["H100"], Parallelism(1)), 8192)
    assert tp1.setting == "tensor_parallel_size" and "split the weights over more GPUs" in tp1.reason
    shapes = shape_misfits(llama, Parallelism(3))
    assert [m.setting for m in shapes] == ["tensor_parallel_size", "tensor_parallel_size"]
    assert "3 does not divide Llama-3.1-70B's 64 attention heads" in shapes[0].reason
    assert "3 and Llama-3.1-70B's 8 KV heads must divide one another" in shapes[1].reason
    assert shape_misfits(llama, Parallelism(2, 4, True))[0].reason == "Llama-3.1-70B has no routed experts to place"


def test_engine_step_is_timed_on_one_gpu_and_equals_the_aggregate_for_pure_tp() -> None:
    costs = model_costs(builtin_model("Llama-3-70B"))
    mem = engine_memory(costs.model, "H100", GPUS["H100"], Parallelism(8))
    replica = engine_replica("p5.48xlarge", 8)
    kv_total = 64 * 4096 * 327_680  # 64 sequences of 4096 tokens
    step = engine_step_seconds(costs, mem, replica, 64, kv_bytes_read=kv_total, mean_context=4096, eff=Efficiency())
    # per GPU: weights but the embedding lookup, 139,003,428,864 B / 8, plus an eighth of the KV; 3.35 TB/s x 0.7
    per_gpu = (2 * (LLAMA_PARAMS - LLAMA_EMBEDDING)) / 8 + kv_total / 8
    assert step == pytest.approx(per_gpu / (3.35e12 * 0.7)) and step == pytest.approx(11.988e-3, rel=1e-3)
    aggregate = decode_step_seconds(costs, replica, 64, kv_bytes_read=kv_total, mean_context=4096, eff=Efficiency())
    assert step == pytest.approx(aggregate)
    # The same 8 GPUs as 8 DP groups of TP 1: each GPU streams a whole copy of the weights and the KV of its own 8
    # sequences (an eighth of the total): 149.7 GB per step, 5.3 times as long (were the weights to fit).
    dp8 = engine_memory(costs.model, "H100", GPUS["H100"], Parallelism(1, 8))
    slower = engine_step_seconds(costs, dp8, replica, 64, kv_bytes_read=kv_total, mean_context=4096, eff=Efficiency())
    assert slower == pytest.approx((2 * (LLAMA_PARAMS - LLAMA_EMBEDDING) + kv_total / 8) / (3.35e12 * 0.7))


def _inputs(**kw: object) -> PlanInputs:
    base = PlanInputs(
        model=builtin_model("DeepSeek-V3"),
        prefill_instance="p5e.48xlarge",
        decode_instance="p5e.48xlarge",
        link=LinkSpec(400, 10, 0.0, 8),
        workload=from_distribution(4, 4096, 512),
        slo=Slo(2000, 80),
        weight_bytes=1.0,
        block_size=64,
        context_tokens=8192,
        max_batch=8192,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_plan_sizes_the_decode_batch_from_the_engines_kv() -> None:
    pool = Parallelism(1, 32, True)
    plan = make_plan(_inputs(prefill_parallel=Parallelism(8), decode_parallel=pool))
    assert plan.decode.gpus == 32 and plan.decode.nodes == 4 and plan.prefill.nodes == 1
    assert plan.decode_memory is not None and plan.decode_memory.experts_per_gpu == 8
    # the batch the KV holds at the workload's context (4096 + 512 = 4608 tokens = 72 blocks of 64)
    held = 32 * int(plan.decode_memory.kv_room_bytes // (4608 * 70_272))
    assert plan.decode_point.batch <= held
    assert plan.viable, plan.reasons


def test_a_plan_whose_engine_cannot_load_says_which_setting() -> None:
    plan = make_plan(_inputs(decode_instance="p5.48xlarge", decode_parallel=Parallelism(8, 1, True)))
    assert not plan.viable
    assert plan.reasons[0].startswith("decode data_parallel_size: weights need 84.8 GB per H100")


def test_plan_command_takes_parallelism_options() -> None:
    args = [
        "plan",
        "--model",
        "DeepSeek-V3",
        "--prefill",
        "p5e.48xlarge",
        "--decode",
        "p5e.48xlarge",
        "--bandwidth-gbps",
        "400",
        "--rtt-ms",
        "10",
        "--rate",
        "4",
        "--input-mean",
        "4096",
        "--output-mean",
        "512",
        "--ttft-ms",
        "2000",
        "--tpot-ms",
        "80",
        "--prefill-tp",
        "8",
        "--decode-tp",
        "1",
        "--decode-dp",
        "32",
        "--decode-ep",
        "--block-size",
        "64",
        "--context-tokens",
        "8192",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    data = json.loads(result.stdout)
    decode = data["parallelism"]["decode"]
    assert (decode["expert_parallel_size"], decode["experts_per_gpu"], decode["nodes"]) == (32, 8, 4)
    assert decode["weights_gb_per_gpu"] == pytest.approx(37.551276032)
    assert decode["max_batch_at_context"] == 5120 and decode["kv_bytes_per_token_per_gpu"] == 70_272
    assert data["parallelism"]["prefill"]["expert_parallel_size"] == 1
    bad = CliRunner().invoke(app, [*args[:-1], "--decode-tp", "0"])
    assert bad.exit_code == 2 and "tensor_parallel_size and data_parallel_size must be at least 1" in bad.output


def _plan_json(stacks: Path) -> tuple[dict[str, Any], int]:
    result = CliRunner().invoke(app, ["plan", "--env", "prod", "--stacks", str(stacks), "--json"])
    return json.loads(result.stdout), result.exit_code


def test_plan_from_stacks_reads_the_vllm_settings() -> None:
    data, code = _plan_json(STACKS)
    prefill, decode = data["parallelism"]["prefill"], data["parallelism"]["decode"]
    assert prefill["tensor_parallel_size"] == decode["tensor_parallel_size"] == 8
    assert prefill["expert_parallel_size"] == decode["expert_parallel_size"] == 1  # Llama-3.1-70B: dense
    assert decode["kv_bytes_per_token_per_gpu"] == 80 * 2 * 1 * 128 * 2  # one of the 8 KV heads per GPU
    assert prefill["block_size"] == decode["block_size"] == 16 and decode["context_tokens"] == 40960
    assert code == 0, data["verdict"]


def test_plan_from_stacks_reads_expert_parallelism(stacks_dir: Path) -> None:
    # Qwen3-Next (512 routed experts, hybrid) in prod, through nixl with decode moved beside prefill (PdstackConnector
    # cannot serve a hybrid model), EP on both sides and 32 redundant experts on decode.
    def beside_prefill(c: dict[str, Any]) -> None:
        c["aws:region"] = "us-east-1"
        c["pdstack:datacenter"]["region"] = "us-east-1"

    def hybrid_moe(c: dict[str, Any]) -> None:
        serving = c["pdstack:serving"]
        serving["model"]["name"] = "qwen3-next-80b-a3b-instruct"
        serving["vllm"].update(kv_connector="nixl", block_size=544)
        serving["vllm"]["prefill"]["enable_expert_parallel"] = True
        serving["vllm"]["decode"].update(enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=32)

    edit(stacks_dir / "Pulumi.prod-decode-us-west-2.yaml", beside_prefill)
    edit(stacks_dir / "Pulumi.prod-control.yaml", hybrid_moe)
    data, code = _plan_json(stacks_dir)
    prefill, decode = data["parallelism"]["prefill"], data["parallelism"]["decode"]
    assert (prefill["tensor_parallel_size"], prefill["experts_per_gpu"]) == (8, 512 // 8)
    assert (decode["tensor_parallel_size"], decode["experts_per_gpu"]) == (8, (512 + 32) // 8)
    assert prefill["block_size"] == decode["block_size"] == 544 and decode["context_tokens"] == 40960
    assert code == 0, data["verdict"]
