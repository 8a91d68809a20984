"""A plan for people (rich tables, each figure beside the formula it came from) and for machines (JSON)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from pdstack.plan.kv import (
    full_attention_bytes_per_token_per_layer,
    linear_state_bytes_per_layer,
    mla_bytes_per_token_per_layer,
)
from pdstack.plan.models import Attention
from pdstack.plan.parallel import EngineMemory
from pdstack.plan.planner import Plan, Planner


def kv_rows(plan: Plan) -> list[dict[str, Any]]:
    """KV bytes by layer type, each with the formula and its inputs."""
    model, b = plan.costs.model, plan.inputs.kv_bytes
    rows: list[dict[str, Any]] = []
    for kind in Attention:
        layers = model.count(kind)
        if not layers:
            continue
        if kind in (Attention.FULL, Attention.SLIDING):
            per_layer = full_attention_bytes_per_token_per_layer(model, b)
            formula = f"2 x {model.num_kv_heads} kv_heads x {model.head_dim} head_dim x {b} B"
            unit = "bytes/token"
            if kind is Attention.SLIDING:
                unit += f" (kept for the last {model.sliding_window} tokens)"
        elif kind is Attention.MLA:
            assert model.mla is not None
            per_layer = mla_bytes_per_token_per_layer(model, b)
            formula = f"({model.mla.kv_lora_rank} kv_lora_rank + {model.mla.qk_rope_head_dim} qk_rope_head_dim) x {b} B"
            unit = "bytes/token"
        else:
            assert model.linear is not None
            lin = model.linear
            per_layer = linear_state_bytes_per_layer(model, b)
            formula = (
                f"({lin.num_value_heads} v_heads x {lin.key_head_dim} x {lin.value_head_dim} + "
                f"({lin.conv_kernel}-1) x {lin.conv_dim} conv) x {b} B"
            )
            unit = "bytes/request"
        rows.append(
            {
                "layer_type": kind.value,
                "layers": layers,
                "per_layer": per_layer,
                "total": per_layer * layers,
                "unit": unit,
                "formula": formula,
            }
        )
    return rows


def engine_json(memory: EngineMemory, plan: Plan, nodes: int) -> dict[str, Any]:
    """One side's vLLM engine, per GPU (see parallel.py for the formulas)."""
    par, gb = memory.parallelism, 1e9
    mean_context = round(sum(i + o for i, o in plan.inputs.workload.requests) / len(plan.inputs.workload.requests))
    return {
        "tensor_parallel_size": par.tensor_parallel_size,
        "data_parallel_size": par.data_parallel_size,
        "expert_parallel_size": par.ep_size,
        "num_redundant_experts": par.num_redundant_experts,
        "gpus": par.gpus,
        "nodes": nodes,
        "gpu": memory.gpu,
        "budget_gb_per_gpu": memory.budget_bytes / gb,
        "weights_gb_per_gpu": memory.weight_bytes / gb,
        "shared_weights_gb_per_gpu": memory.shared_weight_bytes / gb,
        "expert_weights_gb_per_gpu": memory.expert_weight_bytes / gb,
        "experts_per_gpu": memory.experts_per_gpu,
        "kv_heads_per_gpu": memory.kv_heads_per_gpu,
        "kv_bytes_per_token_per_gpu": memory.kv_bytes_per_token,
        "kv_room_gb_per_gpu": memory.kv_room_bytes / gb,
        "kv_tokens_per_dp_group": memory.tokens_per_group(),
        "block_size": memory.block_size,
        "context_tokens": plan.context_tokens,
        "max_batch_at_context": memory.max_batch(plan.context_tokens),
        "max_batch_at_mean_context": memory.max_batch(mean_context),
        "mean_context_tokens": mean_context,
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    planner = Planner(plan.inputs)
    inp, wl, link = plan.inputs, plan.inputs.workload, plan.inputs.link
    mean_in = round(wl.mean_input)
    kv_mean = plan.costs.kv.bytes_for(mean_in)
    prefill_mean = planner.remote_prefill_s(mean_in)
    return {
        "model": {
            "name": plan.costs.model.name,
            "source": plan.costs.model.source,
            "model_type": plan.costs.model.model_type,
            "layers": plan.costs.model.layer_mix(),
            "params_total": plan.costs.params.total,
            "params_active_per_token": plan.costs.params.active_per_token,
            "weight_bytes": plan.costs.weight_bytes,
        },
        "kv": {
            "bytes_per_element": inp.kv_bytes,
            "bytes_per_token": plan.costs.kv.growing_per_token + plan.costs.kv.sliding_per_token,
            "growing_bytes_per_token": plan.costs.kv.growing_per_token,
            "fixed_bytes_per_request": plan.costs.kv.linear_state_per_request,
            "by_layer_type": kv_rows(plan),
        },
        "workload": {
            "description": wl.description,
            "requests_per_second": wl.requests_per_second,
            "input_tokens": {
                "mean": wl.mean_input,
                "p50": wl.input_percentile(50),
                "p90": wl.input_percentile(90),
                "p99": wl.input_percentile(99),
            },
            "output_tokens": {
                "mean": wl.mean_output,
                "p50": wl.output_percentile(50),
                "p90": wl.output_percentile(90),
                "p99": wl.output_percentile(99),
            },
        },
        "hardware": {
            side: {
                "instance_type": r.instance_type,
                "gpu": r.gpu,
                "nodes_per_replica": r.nodes,
                "gpus": r.gpus,
                "dense_tflops": r.dense_flops / 1e12,
                "memory_bandwidth_tbps": r.memory_bandwidth / 1e12,
                "memory_gb": r.memory_bytes / 1e9,
            }
            for side, r in (("prefill", plan.prefill), ("decode", plan.decode))
        },
        "prefill": {
            "mean_prompt_tokens": mean_in,
            "seconds_at_mean_prompt": prefill_mean,
            "kv_bytes_at_mean_prompt": kv_mean,
            "kv_generation_gbps_per_replica": kv_mean * 8 / prefill_mean / 1e9,
            "efficiency_mfu": inp.efficiency.prefill_mfu,
        },
        "decode": {
            "batch": plan.decode_point.batch,
            "step_ms": plan.decode_point.step_s * 1e3,
            "tokens_per_second_per_replica": plan.decode_point.tokens_per_s,
            "memory_limited": plan.decode_point.memory_limited,
            "efficiency_mbu": inp.efficiency.decode_mbu,
        },
        "link": {
            "bandwidth_gbps": link.bandwidth_gbps,
            "rtt_ms": link.rtt_ms,
            "loss_pct": link.loss_pct,
            "streams": link.streams,
            "mss_bytes": link.mss_bytes,
            "mathis_gbps_per_stream": link.mathis_gbps_per_stream,
            "effective_gbps": link.effective_gbps,
            "transfer_ms_at_mean_prompt": link.transfer_seconds(kv_mean) * 1e3,
            "exposed_ms_at_mean_prompt": planner.exposed_s(mean_in) * 1e3,
            "planned_kv_gbps": plan.planned_kv_gbps,
            "required_gbps_with_headroom": plan.required_link_gbps,
            "carries_planned_rate": plan.link_ok,
        },
        "sizing": {
            "headroom_pct": inp.headroom_pct,
            "offload_threshold_tokens_configured": inp.offload_threshold_tokens,
            "remote_share": plan.remote_share,
            "prefill_load_replicas": plan.prefill_load,
            "decode_load_replicas": plan.decode_load,
            "prefill_replicas": plan.prefill_replicas,
            "decode_replicas": plan.decode_replicas,
            "prefill_nodes": plan.prefill_replicas * plan.prefill.nodes,
            "decode_nodes": plan.decode_replicas * plan.decode.nodes,
            "pd_ratio": plan.prefill_replicas / plan.decode_replicas,
        },
        "slo": {
            "ttft_ms": inp.slo.ttft_ms,
            "tpot_ms": inp.slo.tpot_ms,
            "target": inp.slo.target,
            "ttft_attainment": plan.ttft_attainment,
            "ttft_attainment_without_queueing": plan.ttft_attainment_unqueued,
            "tpot_attainment": plan.tpot_attainment,
            "goodput_rps": plan.goodput_rps,
        },
        "parallelism": {
            side: engine_json(memory, plan, replica.nodes)
            for side, memory, replica in (
                ("prefill", plan.prefill_memory, plan.prefill),
                ("decode", plan.decode_memory, plan.decode),
            )
            if memory is not None
        },
        "verdict": {
            "viable": plan.viable,
            "reasons": list(plan.reasons),
            "offload_threshold_tokens": plan.offload_threshold,
        },
    }


def _gbit(value: float) -> str:
    return f"{value:,.3g} Gbit/s"


def render_plan(plan: Plan, console: Console) -> None:
    data = plan_json(plan)
    m, kv, wl = data["model"], data["kv"], data["workload"]
    console.print(f"[bold]{m['name']}[/bold] ({m['model_type']}; {m['source']})")
    console.print(
        f"layers {m['layers']}, {m['params_total'] / 1e9:.1f} B params, {m['params_active_per_token'] / 1e9:.2f} B "
        f"active per token, weights {m['weight_bytes'] / 1e9:.0f} GB"
    )
    table = Table(title="KV cache by layer type")
    for col in ("layer type", "layers", "per layer", "total", "unit", "formula"):
        table.add_column(col)
    for row in kv["by_layer_type"]:
        table.add_row(
            row["layer_type"],
            str(row["layers"]),
            f"{row['per_layer']:,}",
            f"{row['total']:,}",
            row["unit"],
            row["formula"],
        )
    console.print(table)
    console.print(f"workload: {wl['description']}")
    figures = Table(title="Plan", show_header=True)
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    figures.add_column("how")
    for name, value, how in _figure_rows(data):
        figures.add_row(name, value, how)
    console.print(figures)
    if data["parallelism"]:
        console.print(_engine_table(data["parallelism"]))
    verdict = data["verdict"]
    colour = "green" if verdict["viable"] else "red"
    console.print(f"[{colour}]cross-datacenter split {'viable' if verdict['viable'] else 'NOT viable'}[/{colour}]")
    for reason in verdict["reasons"]:
        console.print(f"  - {reason}")


def _figure_rows(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    p, dec, link, s, slo, hw = d["prefill"], d["decode"], d["link"], d["sizing"], d["slo"], d["hardware"]
    threshold = d["verdict"]["offload_threshold_tokens"]
    return [
        (
            "prefill time",
            f"{p['seconds_at_mean_prompt'] * 1e3:,.1f} ms",
            f"FLOPs at {p['mean_prompt_tokens']} tokens / ({hw['prefill']['dense_tflops']:,.0f} TFLOP/s x "
            f"{p['efficiency_mfu']:g} MFU) on {hw['prefill']['nodes_per_replica']} x {hw['prefill']['instance_type']}",
        ),
        ("KV per prompt", f"{p['kv_bytes_at_mean_prompt'] / 1e6:,.1f} MB", "KV bytes at the mean prompt"),
        ("KV generation rate", _gbit(p["kv_generation_gbps_per_replica"]), "KV per prompt x 8 / prefill time"),
        (
            "link effective",
            _gbit(link["effective_gbps"]),
            f"min({link['bandwidth_gbps']:g} Gbit/s, {link['streams']} streams x Mathis "
            f"{'no ceiling' if link['mathis_gbps_per_stream'] is None else _gbit(link['mathis_gbps_per_stream'])})",
        ),
        (
            "KV transfer",
            f"{link['transfer_ms_at_mean_prompt']:,.1f} ms",
            f"exposed after layer-wise overlap + RTT: {link['exposed_ms_at_mean_prompt']:,.1f} ms",
        ),
        (
            "planned KV rate",
            _gbit(link["planned_kv_gbps"]),
            f"rate x mean KV of remote prompts; with {s['headroom_pct']:g} % headroom "
            f"{_gbit(link['required_gbps_with_headroom'])}",
        ),
        (
            "decode step",
            f"{dec['step_ms']:,.2f} ms",
            f"batch {dec['batch']}: (weights touched + KV) / ({hw['decode']['memory_bandwidth_tbps']:g} TB/s x "
            f"{dec['efficiency_mbu']:g})",
        ),
        ("decode throughput", f"{dec['tokens_per_second_per_replica']:,.0f} tok/s", "per replica: batch / step"),
        (
            "prefill replicas",
            str(s["prefill_replicas"]),
            f"load {s['prefill_load_replicas']:.2f} x (1 + headroom), then to the TTFT target; "
            f"{s['prefill_nodes']} x {hw['prefill']['instance_type']}",
        ),
        (
            "decode replicas",
            str(s["decode_replicas"]),
            f"load {s['decode_load_replicas']:.2f} x (1 + headroom); "
            f"{s['decode_nodes']} x {hw['decode']['instance_type']}",
        ),
        ("P:D ratio", f"{s['prefill_replicas']}:{s['decode_replicas']}", f"{s['pd_ratio']:.2f}"),
        (
            "TTFT attainment",
            f"{slo['ttft_attainment']:.1%}",
            f"SLO {slo['ttft_ms']:g} ms, M/G/1 queue per prefill replica; without queueing "
            f"{slo['ttft_attainment_without_queueing']:.1%}",
        ),
        ("TPOT attainment", f"{slo['tpot_attainment']:.1%}", f"SLO {slo['tpot_ms']:g} ms"),
        ("goodput", f"{slo['goodput_rps']:,.2f} req/s", "rate x share meeting both SLOs"),
        (
            "offload threshold",
            "never" if threshold is None else f"{threshold:,} tokens",
            "shortest prompt from which remote prefill gives the lower TTFT",
        ),
    ]


def _engine_table(engines: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="vLLM engine, per GPU")
    table.add_column("figure")
    for side in engines:
        table.add_column(side, justify="right")
    table.add_column("how")
    rows: list[tuple[str, str, str]] = [
        ("shape", "{tensor_parallel_size} TP x {data_parallel_size} DP, EP {expert_parallel_size}", "GPUs = TP x DP"),
        ("GPUs / nodes", "{gpus} x {gpu} / {nodes}", "nodes = ceil(GPUs / GPUs per node)"),
        ("budget", "{budget_gb_per_gpu:.1f} GB", "gpu_memory_utilization x GPU memory"),
        ("weights", "{weights_gb_per_gpu:.2f} GB", "shared / TP (+ replicated) + routed experts on the busiest GPU"),
        ("experts", "{experts_per_gpu}", "ceil((experts + redundant) / EP) whole experts per GPU"),
        ("KV heads", "{kv_heads_per_gpu}", "max(1, kv_heads // TP); MLA keeps its latent on every GPU"),
        ("KV per token", "{kv_bytes_per_token_per_gpu:,.0f} B", "growing layers, this GPU's heads"),
        ("KV room", "{kv_room_gb_per_gpu:.2f} GB", "budget - weights"),
        ("KV tokens", "{kv_tokens_per_dp_group:,}", "per DP group, whole blocks of {block_size}"),
        ("batch at context", "{max_batch_at_context:,}", "DP x sequences of context_tokens a group holds"),
        ("batch at mean", "{max_batch_at_mean_context:,}", "the same at the workload's mean context"),
    ]
    first = next(iter(engines.values()))
    for name, value, how in rows:
        table.add_row(name, *(value.format(**e) for e in engines.values()), how.format(**first))
    return table
