"""`pdstack plan`: options, defaults taken from an environment's stacks, and output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pdstack.model import Engine, PoolRole, Serving
from pdstack.plan.hardware import HardwareError
from pdstack.plan.link import LinkSpec
from pdstack.plan.models import ModelError, ModelSpec, resolve_model
from pdstack.plan.parallel import Parallelism
from pdstack.plan.planner import PlanInputs, Slo, make_plan
from pdstack.plan.quotas import quota_needs, render_quotas
from pdstack.plan.render import plan_json, render_plan
from pdstack.plan.stacks import control_of, kv_links, link_checks, model_for
from pdstack.plan.timing import Efficiency
from pdstack.plan.workload import WorkloadError, from_distribution, from_trace
from pdstack.stacks.files import StackFile
from pdstack.stacks.options import JsonOption, StacksOption, environment, stacks_dir

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


@dataclass
class StackDefaults:
    """What an environment's stack files say about the plan's inputs."""

    values: dict[str, Any]
    stacks: list[StackFile]


def stack_defaults(stacks_dir: Path, env: str) -> StackDefaults:
    stacks = list(environment(stacks_dir, env).stacks)
    values: dict[str, Any] = {}
    control = control_of(stacks)
    if control is not None and control.config.serving is not None:
        serving = control.config.serving
        model, _ = model_for(control.config)
        values["model"] = model.name if model is not None else serving.model.name
        values["streams"] = serving.kv_streams
        values["offload_threshold"] = serving.offload_threshold_tokens
        values.update(vllm_defaults(serving))
        cap = control.config.capacity
        if cap is not None:
            values.update(
                rate=cap.requests_per_second,
                input_mean=cap.mean_input_tokens,
                output_mean=cap.mean_output_tokens,
                ttft_ms=cap.ttft_slo_ms,
                tpot_ms=cap.tpot_slo_ms,
                headroom_pct=cap.headroom_pct,
            )
    for role, key in ((PoolRole.PREFILL, "prefill"), (PoolRole.DECODE, "decode")):
        pool = next((p for s in stacks for p in s.config.datacenter.pools if p.role is role), None)
        if pool is not None:
            values[key] = pool.instance_type
    links = kv_links(stacks)
    if links:
        link = links[0][2]
        values.update(bandwidth_gbps=link.bandwidth_gbps, rtt_ms=link.rtt_ms, loss_pct=link.loss_pct)
    return StackDefaults(values, stacks)


def vllm_defaults(serving: Serving) -> dict[str, Any]:
    """What a vLLM serving block says about the plan: each side's parallelism, memory share, block, context."""
    v = serving.vllm
    if serving.engine is not Engine.VLLM or v is None:
        return {}
    values: dict[str, Any] = {
        "gpu_memory_utilization": v.setting(PoolRole.DECODE, "gpu_memory_utilization")[0],
        "block_size": v.setting(PoolRole.DECODE, "block_size")[0],
        "context_tokens": v.max_model_len,
    }
    if v.kv_cache_dtype == "fp8":
        values["kv_dtype"] = "fp8"
    for role in (PoolRole.PREFILL, PoolRole.DECODE):
        r = v.role(role)
        values[f"{role}_parallel"] = Parallelism(
            r.tensor_parallel_size, r.data_parallel_size, r.enable_expert_parallel, r.num_redundant_experts
        )
    return values


def parallelism(
    side: str,
    defaults: dict[str, Any],
    *,
    tp: int | None,
    dp: int | None,
    ep: bool | None,
    redundant: int | None,
) -> Parallelism | None:
    """A side's engine shape: the options given, over what the stacks say; None when neither says anything."""
    base: Parallelism | None = defaults.get(f"{side}_parallel")
    if base is None and tp is None and dp is None and ep is None and redundant is None:
        return None
    base = base or Parallelism()
    return Parallelism(
        tp if tp is not None else base.tensor_parallel_size,
        dp if dp is not None else base.data_parallel_size,
        ep if ep is not None else base.enable_expert_parallel,
        redundant if redundant is not None else base.num_redundant_experts,
    )


def weight_dtype_of(model: ModelSpec, given: str | None) -> str:
    """The weights' precision: as given, else the checkpoint's (FP8 checkpoints say so in quantization_config)."""
    if given is not None:
        return given
    return "fp8" if model.fp8_weights else "bf16"


def _pick(name: str, given: Any, defaults: dict[str, Any], fallback: Any = None) -> Any:
    value = given if given is not None else defaults.get(name, fallback)
    if value is None:
        raise typer.BadParameter(f"--{name.replace('_', '-')} is required (or take it from a stack with --env)")
    return value


def plan_command(
    *,
    model: Annotated[str | None, typer.Option(help="built-in model name/alias, or a config.json path")] = None,
    prefill: Annotated[str | None, typer.Option(help="prefill instance type (catalog)")] = None,
    decode: Annotated[str | None, typer.Option(help="decode instance type (catalog)")] = None,
    bandwidth_gbps: Annotated[float | None, typer.Option(help="link bandwidth, Gbit/s")] = None,
    rtt_ms: Annotated[float | None, typer.Option(help="link round-trip time, ms")] = None,
    loss_pct: Annotated[float | None, typer.Option(help="link packet loss, percent")] = None,
    streams: Annotated[int | None, typer.Option(help="TCP connections per KV pull")] = None,
    rate: Annotated[float | None, typer.Option(help="arrival rate, requests/s")] = None,
    input_mean: Annotated[float | None, typer.Option(help="mean prompt tokens")] = None,
    output_mean: Annotated[float | None, typer.Option(help="mean output tokens")] = None,
    input_cv: Annotated[float, typer.Option(help="prompt length coefficient of variation (lognormal)")] = 0.0,
    output_cv: Annotated[float, typer.Option(help="output length coefficient of variation (lognormal)")] = 0.0,
    trace: Annotated[Path | None, typer.Option(help="JSONL/CSV with input_tokens, output_tokens per request")] = None,
    ttft_ms: Annotated[float | None, typer.Option(help="TTFT SLO, ms")] = None,
    tpot_ms: Annotated[float | None, typer.Option(help="TPOT SLO, ms")] = None,
    slo_target: Annotated[float, typer.Option(help="share of requests that must meet each SLO")] = 0.9,
    headroom_pct: Annotated[float | None, typer.Option(help="spare capacity, 20-30 %")] = None,
    offload_threshold: Annotated[int | None, typer.Option(help="prompts shorter than this prefill on decode")] = None,
    kv_dtype: Annotated[str | None, typer.Option(help="KV cache precision: bf16, fp16, fp8 [default: bf16]")] = None,
    weight_dtype: Annotated[
        str | None, typer.Option(help="weight precision: bf16, fp16, fp8 [default: the checkpoint's]")
    ] = None,
    prefill_tp: Annotated[int | None, typer.Option(help="vLLM prefill tensor_parallel_size")] = None,
    prefill_dp: Annotated[int | None, typer.Option(help="vLLM prefill data_parallel_size")] = None,
    prefill_ep: Annotated[bool | None, typer.Option(help="vLLM prefill enable_expert_parallel")] = None,
    prefill_redundant_experts: Annotated[int | None, typer.Option(help="prefill EPLB redundant experts")] = None,
    decode_tp: Annotated[int | None, typer.Option(help="vLLM decode tensor_parallel_size")] = None,
    decode_dp: Annotated[int | None, typer.Option(help="vLLM decode data_parallel_size")] = None,
    decode_ep: Annotated[bool | None, typer.Option(help="vLLM decode enable_expert_parallel")] = None,
    decode_redundant_experts: Annotated[int | None, typer.Option(help="decode EPLB redundant experts")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(help="vLLM's share of GPU memory")] = None,
    block_size: Annotated[int | None, typer.Option(help="vLLM KV block size, tokens")] = None,
    context_tokens: Annotated[
        int | None, typer.Option(help="vLLM max_model_len: the context one sequence holds")
    ] = None,
    prefill_mfu: Annotated[float, typer.Option(help="achieved share of dense FLOP/s in prefill")] = 0.5,
    decode_mbu: Annotated[float, typer.Option(help="achieved share of memory bandwidth in decode")] = 0.7,
    max_batch: Annotated[int, typer.Option(help="most sequences in one decode step")] = 256,
    env: Annotated[
        str | None, typer.Option("--env", metavar="NAME", help="take defaults from this environment's stack files")
    ] = None,
    stacks: StacksOption = None,
    old_stacks_dir: Annotated[
        Path | None, typer.Option("--stacks-dir", hidden=True, help="deprecated spelling of --stacks")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Plan prefill/decode capacity and the cross-datacenter link for a model and workload."""
    folder = stacks_dir(stacks, old_stacks_dir, "--stacks-dir") if env else None
    defaults = stack_defaults(folder, env) if folder is not None and env else StackDefaults({}, [])
    d = defaults.values
    try:
        spec = resolve_model(_pick("model", model, d))
        kv_dtype = _pick("kv_dtype", kv_dtype, d, "bf16")
        weight_dtype = weight_dtype_of(spec, weight_dtype)
        for name, dtype in (("--kv-dtype", kv_dtype), ("--weight-dtype", weight_dtype)):
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        headroom = _pick("headroom_pct", headroom_pct, d, 25.0)
        if not 20 <= headroom <= 30:
            raise ValueError(f"--headroom-pct must be 20-30, got {headroom:g}")
        rps = _pick("rate", rate, d)
        workload = (
            from_trace(rps, trace)
            if trace is not None
            else from_distribution(
                rps, _pick("input_mean", input_mean, d), _pick("output_mean", output_mean, d), input_cv, output_cv
            )
        )
        inputs = PlanInputs(
            model=spec,
            prefill_instance=_pick("prefill", prefill, d),
            decode_instance=_pick("decode", decode, d),
            link=LinkSpec(
                _pick("bandwidth_gbps", bandwidth_gbps, d),
                _pick("rtt_ms", rtt_ms, d),
                _pick("loss_pct", loss_pct, d, 0.0),
                _pick("streams", streams, d, 4),
            ),
            workload=workload,
            slo=Slo(_pick("ttft_ms", ttft_ms, d), _pick("tpot_ms", tpot_ms, d), slo_target),
            headroom_pct=headroom,
            offload_threshold_tokens=_pick("offload_threshold", offload_threshold, d, 0),
            max_batch=max_batch,
            kv_bytes=DTYPE_BYTES[kv_dtype],
            weight_bytes=DTYPE_BYTES[weight_dtype],
            efficiency=Efficiency(prefill_mfu, decode_mbu),
            prefill_parallel=parallelism(
                "prefill", d, tp=prefill_tp, dp=prefill_dp, ep=prefill_ep, redundant=prefill_redundant_experts
            ),
            decode_parallel=parallelism(
                "decode", d, tp=decode_tp, dp=decode_dp, ep=decode_ep, redundant=decode_redundant_experts
            ),
            gpu_memory_utilization=_pick("gpu_memory_utilization", gpu_memory_utilization, d, 0.92),
            block_size=_pick("block_size", block_size, d, 16),
            context_tokens=_pick("context_tokens", context_tokens, d, 0) or None,
        )
        plan = make_plan(inputs)
    except (ModelError, HardwareError, WorkloadError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        out = plan_json(plan)
        if defaults.stacks:
            out["link_checks"] = [c.as_json() for c in link_checks(defaults.stacks)]
            out["quotas"] = [n.as_json() for n in quota_needs(defaults.stacks)]
        typer.echo(json.dumps(out, indent=2))
    else:
        console = Console()
        render_plan(plan, console)
        if defaults.stacks:
            console.print(render_quotas(quota_needs(defaults.stacks)))
    raise typer.Exit(0 if plan.viable else 1)
