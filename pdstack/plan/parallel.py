"""Per-GPU memory of one vLLM engine under tensor, data and expert parallelism (TP, DP, EP).

An engine is TP x DP GPUs: DP groups (vLLM's data-parallel engine cores) of TP GPUs each. Per GPU, following
vLLM 0.32's sharding (llama.py, deepseek_v2.py, fused_moe/config.py, expert_map_manager.py):
- weights outside the routed experts are split across the TP group and repeated in every DP group, except what
  vLLM keeps whole on each GPU (the MoE router, MLA's q_a_proj and kv_a_proj_with_mqa):
  (shared - replicated) / TP + replicated;
- routed experts are split across all TP x DP GPUs: without expert parallelism each expert's matrices are cut
  TP x DP ways (vLLM flattens TP across DP for MoE layers); with it (EP = TP x DP) a GPU holds whole experts,
  ceil((experts + redundant) / EP) on the busiest GPU;
- KV per token: full and sliding layers hold max(1, kv_heads // TP) KV heads per GPU (heads are replicated when
  kv_heads < TP); MLA holds its whole latent (kv_lora_rank + qk_rope_head_dim) on every GPU of the TP group;
  linear-attention state per sequence is split by TP over its heads;
- budget = gpu_memory_utilization x GPU memory; KV room = budget - weights (vLLM also subtracts its measured
  activation peak and CUDA graphs at start-up, which this leaves out: the batch below is an upper bound);
- a DP group holds floor(KV room / KV of one sequence of `context` tokens in whole blocks) sequences, each DP group
  its own; the engine holds DP times that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdstack.plan.catalog import Gpu
from pdstack.plan.compute import ParamCounts, param_counts
from pdstack.plan.models import Attention, ModelSpec


@dataclass(frozen=True)
class Parallelism:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1 or self.num_redundant_experts < 0:
            raise ValueError("tensor_parallel_size and data_parallel_size must be at least 1")

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def ep_size(self) -> int:
        """vLLM uses expert parallelism only when asked and the engine has more than one GPU."""
        return self.gpus if self.enable_expert_parallel and self.gpus > 1 else 1


@dataclass(frozen=True)
class Misfit:
    """A setting that cannot work, and why; the caller names the setting in its own terms."""

    setting: str  # tensor_parallel_size, data_parallel_size, enable_expert_parallel, gpu_memory_utilization, ...
    reason: str


@dataclass(frozen=True)
class EngineMemory:
    """One engine's per-GPU memory, in bytes."""

    parallelism: Parallelism
    gpu: str
    gpu_memory_bytes: float
    utilization: float
    block_size: int
    shared_weight_bytes: float  # attention, dense MLPs, shared experts, embeddings, head, router: per GPU
    expert_weight_bytes: float  # routed experts on the busiest GPU
    experts_per_gpu: int | None  # whole routed experts per GPU (EP); None without EP or for dense models
    kv_heads_per_gpu: int | None  # None when the model has no full or sliding attention layers
    kv_bytes_per_token: float  # growing layers (full + MLA), per GPU
    sliding_bytes_per_token: float
    sliding_window: int | None
    state_bytes_per_sequence: float  # linear-attention state, per GPU

    @property
    def budget_bytes(self) -> float:
        return self.utilization * self.gpu_memory_bytes

    @property
    def weight_bytes(self) -> float:
        return self.shared_weight_bytes + self.expert_weight_bytes

    @property
    def kv_room_bytes(self) -> float:
        return self.budget_bytes - self.weight_bytes

    def sequence_bytes(self, context: int) -> float:
        """Per-GPU KV of one sequence of `context` tokens, in whole blocks."""
        blocks = math.ceil(context / self.block_size)
        kept = blocks * self.block_size
        window = kept if self.sliding_window is None else min(kept, self.block_size * self._window_blocks())
        return self.kv_bytes_per_token * kept + self.sliding_bytes_per_token * window + self.state_bytes_per_sequence

    def _window_blocks(self) -> int:
        assert self.sliding_window is not None
        return math.ceil(self.sliding_window / self.block_size)

    def sequences_per_group(self, context: int) -> int:
        if self.kv_room_bytes <= 0:
            return 0
        return int(self.kv_room_bytes // self.sequence_bytes(context))

    def max_batch(self, context: int) -> int:
        """Sequences of `context` tokens the whole engine holds at once: every DP group its own."""
        return self.parallelism.data_parallel_size * self.sequences_per_group(context)

    def tokens_per_group(self) -> int:
        """Tokens one DP group's KV room holds in growing layers (the figure vLLM logs as KV cache size)."""
        if self.kv_room_bytes <= 0 or self.kv_bytes_per_token == 0:
            return 0
        blocks = int(self.kv_room_bytes // (self.kv_bytes_per_token * self.block_size))
        return blocks * self.block_size


def replicated_params(model: ModelSpec, counts: ParamCounts) -> int:
    """Weights vLLM keeps whole on every GPU: the MoE router, and MLA's low-rank down-projections."""
    router = counts.moe_layers * model.hidden_size * counts.num_experts
    mla = 0
    if model.mla is not None:  # q_a_proj (when q is low-rank) and kv_a_proj_with_mqa are ReplicatedLinear
        m = model.mla
        down = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
        mla = model.count(Attention.MLA) * model.hidden_size * down
    return router + mla


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int | None:
    if not (model.count(Attention.FULL) or model.count(Attention.SLIDING)):
        return None
    return max(1, model.num_kv_heads // tp)


def engine_memory(
    model: ModelSpec,
    gpu_name: str,
    gpu: Gpu,
    par: Parallelism,
    *,
    weight_bytes: float = 2.0,
    kv_bytes: int = 2,
    utilization: float = 0.92,
    block_size: int = 16,
) -> EngineMemory:
    counts = param_counts(model)
    tp = par.tensor_parallel_size
    routed = counts.moe_layers * counts.num_experts * counts.expert
    replicated = replicated_params(model, counts)
    shared = (counts.total - routed - replicated) / tp + replicated
    experts_per_gpu = None
    if counts.num_experts and par.ep_size > 1:
        experts_per_gpu = math.ceil((counts.num_experts + par.num_redundant_experts) / par.ep_size)
        expert = float(counts.moe_layers * experts_per_gpu * counts.expert)
    else:
        expert = routed / par.gpus
    heads = kv_heads_per_gpu(model, tp)
    per_head_token = 2 * model.head_dim * kv_bytes  # K and V of one head, one layer
    mla = 0
    if model.mla is not None:
        mla = model.count(Attention.MLA) * (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_bytes
    state = 0.0
    if model.linear is not None:
        lin = model.linear
        per_layer = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim + (lin.conv_kernel - 1) * lin.conv_dim
        state = model.count(Attention.LINEAR) * per_layer * kv_bytes / tp
    return EngineMemory(
        parallelism=par,
        gpu=gpu_name,
        gpu_memory_bytes=gpu.memory_gb * 1e9,
        utilization=utilization,
        block_size=block_size,
        shared_weight_bytes=shared * weight_bytes,
        expert_weight_bytes=expert * weight_bytes,
        experts_per_gpu=experts_per_gpu,
        kv_heads_per_gpu=heads,
        kv_bytes_per_token=float(model.count(Attention.FULL) * (heads or 0) * per_head_token + mla),
        sliding_bytes_per_token=float(model.count(Attention.SLIDING) * (heads or 0) * per_head_token),
        sliding_window=model.sliding_window,
        state_bytes_per_sequence=state,
    )


def shape_misfits(model: ModelSpec, par: Parallelism) -> list[Misfit]:
    """Parallelism the model's shapes do not allow (vLLM asserts these when it loads the model)."""
    tp, out = par.tensor_parallel_size, []
    if model.num_attention_heads % tp:
        reason = f"{tp} does not divide {model.name}'s {model.num_attention_heads} attention heads"
        out.append(Misfit("tensor_parallel_size", reason))
    kv = model.num_kv_heads
    if kv and kv_heads_per_gpu(model, tp) is not None and (kv % tp if kv >= tp else tp % kv):
        reason = (
            f"{tp} and {model.name}'s {kv} KV heads must divide one another "
            "(heads are split when kv_heads >= TP, replicated when kv_heads < TP)"
        )
        out.append(Misfit("tensor_parallel_size", reason))
    lin = model.linear
    if lin is not None and (lin.num_key_heads % tp or lin.num_value_heads % tp):
        reason = (
            f"{tp} does not divide {model.name}'s {lin.num_key_heads} key and {lin.num_value_heads} value heads "
            "of linear attention"
        )
        out.append(Misfit("tensor_parallel_size", reason))
    experts = model.moe.num_experts if model.moe is not None else 0
    if par.enable_expert_parallel and not experts:
        out.append(Misfit("enable_expert_parallel", f"{model.name} has no routed experts to place"))
    if experts and par.ep_size > experts + par.num_redundant_experts:
        reason = (
            f"EP = TP x DP = {par.ep_size} exceeds {model.name}'s {experts} routed experts "
            f"(+ {par.num_redundant_experts} redundant): some GPUs would hold none"
        )
        out.append(Misfit("data_parallel_size", reason))
    return out


def memory_misfits(mem: EngineMemory, context: int) -> list[Misfit]:
    """Settings with which the engine cannot load its weights, or cannot hold one sequence of `context` tokens."""
    gb, par = 1e9, mem.parallelism
    memory = f"{mem.gpu_memory_bytes / gb:g} GB"
    budget = f"gpu_memory_utilization {mem.utilization:g} x {memory} = {mem.budget_bytes / gb:.1f} GB"
    if mem.kv_room_bytes <= 0:
        moe = mem.expert_weight_bytes > 0
        ep = " with EP" if par.enable_expert_parallel else ""
        shape = f"TP {par.tensor_parallel_size} x DP {par.data_parallel_size}{ep}"
        hint = "spread the experts over more GPUs" if moe else "split the weights over more GPUs"
        reason = f"weights need {mem.weight_bytes / gb:.1f} GB per {mem.gpu} at {shape}, more than {budget}: {hint}"
        return [Misfit("data_parallel_size" if moe else "tensor_parallel_size", reason)]
    one = mem.sequence_bytes(context)
    if one > mem.kv_room_bytes:
        reason = (
            f"one sequence of {context} tokens needs {one / gb:.2f} GB of KV per GPU, but {budget} less "
            f"{mem.weight_bytes / gb:.1f} GB of weights leaves {mem.kv_room_bytes / gb:.2f} GB"
        )
        return [Misfit("max_model_len", reason)]
    return []


def resolved_block_size(model: ModelSpec, tp: int, block_size: int, kv_bytes: int, kernel_multiple: int = 16) -> int:
    """The block size vLLM runs with: a hybrid model's (attention + linear attention) is raised until one attention
    page holds one linear-attention state (vLLM 0.32 platforms/interface.py, _align_hybrid_block_size):
    align x ceil(state page / (align x attention page per token)), align = max(kernel multiple, block_size)."""
    if model.linear is None or not model.count(Attention.LINEAR):
        return block_size
    heads = kv_heads_per_gpu(model, tp) or 1
    attention_page = 2 * heads * model.head_dim * kv_bytes
    lin = model.linear
    state_page = lin.conv_dim * (lin.conv_kernel - 1) + lin.num_value_heads * lin.key_head_dim * lin.value_head_dim
    state_page = state_page * kv_bytes // tp
    if attention_page == 0:
        return block_size  # a degenerate config (head_dim 0) has no pages to align
    align = max(kernel_multiple, block_size)
    needed = align * math.ceil(state_page / (align * attention_page))
    needed = kernel_multiple * math.ceil(needed / kernel_multiple)
    return max(block_size, needed)
