"""Prefill and decode hardware from the catalog: one replica is as many whole instances as its weights need."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdstack.plan.catalog import Catalog, Gpu, InstanceType, load_catalog

USABLE_MEMORY_FRACTION = 0.9  # what an engine leaves itself after CUDA context, activations and fragmentation
WEIGHT_SHARE_MAX = 0.8  # weights may take at most this share of usable memory, leaving the rest for KV


class HardwareError(ValueError):
    """An instance type the planner cannot use: unknown, or without GPUs."""


@dataclass(frozen=True)
class Replica:
    """One model replica: `nodes` instances of `instance_type`, tensor-parallel across all their GPUs."""

    instance_type: str
    gpu: str
    nodes: int
    gpus: int
    dense_flops: float  # FLOP/s, bf16 dense, all GPUs of the replica
    memory_bandwidth: float  # bytes/s, all GPUs
    memory_bytes: float  # bytes, all GPUs
    network_gbps: float  # per node

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * USABLE_MEMORY_FRACTION


def gpu_instance(instance_type: str, catalog: Catalog | None = None) -> tuple[InstanceType, Gpu]:
    catalog = catalog or load_catalog()
    inst = catalog.instance(instance_type)
    if inst is None:
        raise HardwareError(f"unknown instance type {instance_type!r} (known: {', '.join(sorted(catalog.instances))})")
    gpu = catalog.gpu_of(instance_type)
    if gpu is None:
        raise HardwareError(f"instance type {instance_type!r} has no GPU; the planner needs GPU instance types")
    return inst, gpu


def replica_for(instance_type: str, weight_bytes: float, catalog: Catalog | None = None) -> Replica:
    """As many whole instances as the weights need, tensor-parallel across all their GPUs."""
    inst, gpu = gpu_instance(instance_type, catalog)
    node_memory = gpu.memory_gb * 1e9 * inst.gpu_count
    nodes = max(1, math.ceil(weight_bytes / (node_memory * USABLE_MEMORY_FRACTION * WEIGHT_SHARE_MAX)))
    return _replica(instance_type, inst, gpu, nodes * inst.gpu_count)


def engine_replica(instance_type: str, gpus: int, catalog: Catalog | None = None) -> Replica:
    """A vLLM engine of `gpus` GPUs (TP x DP): on as many nodes as hold them."""
    inst, gpu = gpu_instance(instance_type, catalog)
    return _replica(instance_type, inst, gpu, gpus)


def _replica(instance_type: str, inst: InstanceType, gpu: Gpu, gpus: int) -> Replica:
    nodes = math.ceil(gpus / inst.gpu_count)
    return Replica(
        instance_type=instance_type,
        gpu=str(inst.gpu),
        nodes=nodes,
        gpus=gpus,
        dense_flops=gpu.bf16_dense_tflops * 1e12 * gpus,
        memory_bandwidth=gpu.memory_bandwidth_tbps * 1e12 * gpus,
        memory_bytes=gpu.memory_gb * 1e9 * gpus,
        network_gbps=inst.network_gbps,
    )
