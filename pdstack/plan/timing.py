"""How long prefill, decode steps and KV transfers take on given hardware.

- Prefill is compute-bound: prefill FLOPs / (replica dense FLOP/s x prefill efficiency).
- A decode step is bound by the slower of memory and compute: bytes read (the weights the batch touches, MoE
  experts counted by expected distinct hits, plus every sequence's KV) / (replica bandwidth x decode efficiency),
  against 2 FLOPs per active weight per sequence plus attention, at the prefill efficiency.
- On a vLLM engine (TP x DP GPUs, see parallel.py) a decode step is timed per GPU: each GPU reads its shard of
  the weights outside the routed experts (its DP group's copy), its share of the experts the whole batch routes
  to, and the KV of its DP group's sequences, against one GPU's bandwidth; FLOPs are split over all GPUs.
- A remote prefill's KV streams layer by layer while later layers compute, so only what is left after the prefill
  finishes is exposed: max(transfer - prefill, transfer / layers), plus one RTT for the pull.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdstack.plan.compute import ParamCounts, attention_flops, param_counts, prefill_flops
from pdstack.plan.hardware import Replica
from pdstack.plan.kv import KvFootprint, kv_footprint
from pdstack.plan.link import LinkSpec
from pdstack.plan.models import ModelSpec
from pdstack.plan.parallel import EngineMemory


@dataclass(frozen=True)
class Efficiency:
    prefill_mfu: float = 0.5  # achieved share of dense FLOP/s in prefill
    decode_mbu: float = 0.7  # achieved share of memory bandwidth in decode

    def __post_init__(self) -> None:
        for name in ("prefill_mfu", "decode_mbu"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelCosts:
    """A model with its precomputed counts and KV footprint, at given weight and KV precisions."""

    model: ModelSpec
    params: ParamCounts
    kv: KvFootprint
    weight_bytes_per_param: float

    @property
    def weight_bytes(self) -> float:
        return self.params.total * self.weight_bytes_per_param


def model_costs(model: ModelSpec, kv_bytes: int = 2, weight_bytes: float = 2.0) -> ModelCosts:
    return ModelCosts(model, param_counts(model), kv_footprint(model, kv_bytes), weight_bytes)


def prefill_seconds(costs: ModelCosts, replica: Replica, tokens: int, eff: Efficiency) -> float:
    return prefill_flops(costs.model, tokens, costs.params) / (replica.dense_flops * eff.prefill_mfu)


def decode_step_seconds(
    costs: ModelCosts, replica: Replica, batch: int, *, kv_bytes_read: float, mean_context: int, eff: Efficiency
) -> float:
    """One decode step over `batch` sequences that together hold `kv_bytes_read` bytes of KV."""
    streamed = costs.params.touched_by_batch(batch) + (costs.params.embedding if costs.model.tie_word_embeddings else 0)
    memory_s = (streamed * costs.weight_bytes_per_param + kv_bytes_read) / (replica.memory_bandwidth * eff.decode_mbu)
    flops = batch * (2.0 * costs.params.active_per_token + attention_flops(costs.model, 1, mean_context))
    compute_s = flops / (replica.dense_flops * eff.prefill_mfu)
    return max(memory_s, compute_s)


def engine_step_seconds(
    costs: ModelCosts,
    mem: EngineMemory,
    replica: Replica,
    batch: int,
    *,
    kv_bytes_read: float,
    mean_context: int,
    eff: Efficiency,
) -> float:
    """One decode step over `batch` sequences on a vLLM engine, timed on its busiest GPU."""
    par, params, wbytes = mem.parallelism, costs.params, costs.weight_bytes_per_param
    lookup = 0.0 if costs.model.tie_word_embeddings else params.embedding * wbytes / par.tensor_parallel_size
    routed = (params.touched_by_batch(batch) - params.always_active) * wbytes / par.gpus
    growing = costs.kv.growing_per_token
    kv_share = mem.kv_bytes_per_token / growing if growing else 1 / par.tensor_parallel_size
    kv = kv_bytes_read * kv_share / par.data_parallel_size
    gpu_bandwidth = replica.memory_bandwidth / replica.gpus
    memory_s = (mem.shared_weight_bytes - lookup + routed + kv) / (gpu_bandwidth * eff.decode_mbu)
    flops = batch * (2.0 * params.active_per_token + attention_flops(costs.model, 1, mean_context)) / par.gpus
    compute_s = flops / (replica.dense_flops / replica.gpus * eff.prefill_mfu)
    return max(memory_s, compute_s)


def transfer_seconds(kv_bytes: float, link: LinkSpec) -> float:
    return link.transfer_seconds(kv_bytes)


def exposed_transfer_seconds(kv_bytes: float, prefill_s: float, link: LinkSpec, layers: int) -> float:
    """The part of a layer-wise KV transfer that prefill does not hide, plus one RTT for the pull."""
    total = link.transfer_seconds(kv_bytes)
    return link.rtt_ms / 1e3 + max(total - prefill_s, total / max(layers, 1))
