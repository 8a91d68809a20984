"""The capacity plan: node counts, P:D ratio, SLO attainment, link need and the selective-offload threshold.

Sizing, for a workload of rate lambda whose requests of at least `offload_threshold_tokens` prompt tokens are
prefilled remotely (the rest on decode, as the gateway does):
- prefill replicas: at least ceil(lambda_remote x E[prefill time] x (1 + headroom)), and more until the predicted
  share of requests meeting the TTFT SLO reaches the target. Each prefill replica is an M/G/1 queue; its wait
  W has P(W > t) ~ rho x exp(-rho t / E[W]) with E[W] from Pollaczek-Khinchine, lambda E[S^2] / (2 (1 - rho)).
- decode replicas: ceil((lambda x E[output] / tokens-per-second-per-replica + local-prefill busy share)
  x (1 + headroom)), where a replica runs the largest batch whose step time meets the TPOT SLO and whose KV fits.
- with vLLM parallelism (`prefill_parallel`, `decode_parallel`), a replica is one engine of TP x DP GPUs: its
  per-GPU weights and KV, the batch its KV holds and its decode step come from parallel.py, and a setting that
  cannot load or cannot hold one `context_tokens` sequence is a reason the plan is not viable, naming the setting.
- link: the planned KV rate lambda x E[KV bytes of remote prompts], times (1 + headroom), against what the link
  carries (see link.py).
- viable: the link carries that rate, and with enough prefill replicas to remove queueing the TTFT target is
  reachable despite the transfer, and the TPOT SLO is reachable.
- offload threshold: the shortest prompt from which remote prefill (prefill pool + exposed transfer + RTT) gives a
  lower TTFT than prefilling on a decode replica, which may only use the compute its decode batch leaves within
  the TPOT SLO (chunked prefill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from pdstack.plan.hardware import Replica, engine_replica, gpu_instance, replica_for
from pdstack.plan.link import LinkSpec
from pdstack.plan.models import ModelSpec
from pdstack.plan.parallel import (
    EngineMemory,
    Parallelism,
    engine_memory,
    memory_misfits,
    resolved_block_size,
    shape_misfits,
)
from pdstack.plan.timing import (
    Efficiency,
    ModelCosts,
    decode_step_seconds,
    engine_step_seconds,
    exposed_transfer_seconds,
    model_costs,
    prefill_seconds,
)
from pdstack.plan.workload import Workload

MAX_REPLICAS = 100_000


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float
    target: float = 0.9  # share of requests that must meet each SLO (DistServe's attainment goal is 90 %)

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError("SLOs ttft_ms and tpot_ms must be positive")
        if not 0 < self.target <= 1:
            raise ValueError(f"SLO target must be in (0, 1], got {self.target}")


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    prefill_instance: str
    decode_instance: str
    link: LinkSpec
    workload: Workload
    slo: Slo
    headroom_pct: float = 25.0
    offload_threshold_tokens: int = 0  # configured: shorter prompts are prefilled on decode
    max_batch: int = 256
    kv_bytes: int = 2
    weight_bytes: float = 2.0
    efficiency: Efficiency = field(default_factory=Efficiency)
    prefill_parallel: Parallelism | None = None  # a vLLM engine's TP/DP/EP; None: whole instances, TP across all
    decode_parallel: Parallelism | None = None
    gpu_memory_utilization: float = 0.92  # vLLM's default
    block_size: int = 16
    context_tokens: int | None = None  # vLLM's max_model_len; None: the workload's longest request

    def __post_init__(self) -> None:
        if not 0 <= self.headroom_pct <= 100:
            raise ValueError(f"headroom_pct must be in [0, 100], got {self.headroom_pct}")
        if self.max_batch < 1 or self.kv_bytes < 1 or self.weight_bytes <= 0:
            raise ValueError("max_batch and kv_bytes must be at least 1, weight_bytes positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size < 1 or (self.context_tokens is not None and self.context_tokens < 1):
            raise ValueError("block_size and context_tokens must be at least 1")


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    step_s: float
    tokens_per_s: float
    tpot_feasible: bool
    memory_limited: bool


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    costs: ModelCosts
    prefill: Replica
    decode: Replica
    decode_point: DecodePoint
    prefill_replicas: int
    decode_replicas: int
    prefill_load: float  # replica-equivalents busy prefilling remote prompts
    decode_load: float  # replica-equivalents busy decoding and prefilling local prompts
    remote_share: float
    ttft_attainment: float
    ttft_attainment_unqueued: float
    tpot_attainment: float
    goodput_rps: float
    planned_kv_gbps: float
    required_link_gbps: float
    link_ok: bool
    offload_threshold: int | None
    reasons: tuple[str, ...]
    context_tokens: int = 0
    prefill_memory: EngineMemory | None = None  # per-GPU figures, when the inputs give vLLM parallelism
    decode_memory: EngineMemory | None = None

    @property
    def viable(self) -> bool:
        return not self.reasons

    @property
    def headroom(self) -> float:
        return self.inputs.headroom_pct / 100


class Planner:
    """Holds one plan's inputs and the quantities every step shares."""

    def __init__(self, inputs: PlanInputs) -> None:
        self.inputs = inputs
        self.costs = model_costs(inputs.model, inputs.kv_bytes, inputs.weight_bytes)
        self.requests = inputs.workload.requests
        self.context = inputs.context_tokens or max(i + o for i, o in self.requests)
        self.prefill, self.prefill_memory = self._side(inputs.prefill_instance, inputs.prefill_parallel)
        self.decode, self.decode_memory = self._side(inputs.decode_instance, inputs.decode_parallel)
        self.eff = inputs.efficiency
        self.h = inputs.headroom_pct / 100
        self._prefill_memo: dict[int, float] = {}

    def _side(self, instance: str, par: Parallelism | None) -> tuple[Replica, EngineMemory | None]:
        if par is None:
            return replica_for(instance, self.costs.weight_bytes), None
        _, gpu = gpu_instance(instance)
        replica = engine_replica(instance, par.gpus)
        inp = self.inputs
        block = resolved_block_size(inp.model, par.tensor_parallel_size, inp.block_size, inp.kv_bytes)
        memory = engine_memory(
            inp.model,
            replica.gpu,
            gpu,
            par,
            weight_bytes=inp.weight_bytes,
            kv_bytes=inp.kv_bytes,
            utilization=inp.gpu_memory_utilization,
            block_size=block,
        )
        return replica, memory

    def misfits(self) -> list[str]:
        """Each side's vLLM settings that cannot load the model or hold one `context` sequence, by setting."""
        out: list[str] = []
        sides = (
            ("prefill", self.inputs.prefill_parallel, self.prefill_memory),
            ("decode", self.inputs.decode_parallel, self.decode_memory),
        )
        for side, par, memory in sides:
            if par is None or memory is None:
                continue
            found = shape_misfits(self.inputs.model, par) or memory_misfits(memory, self.context)
            out += [f"{side} {m.setting}: {m.reason}" for m in found]
        return out

    # ------------------------------------------------------------------ per-request figures

    def is_remote(self, prompt: int) -> bool:
        return prompt >= self.inputs.offload_threshold_tokens

    def remote_prefill_s(self, prompt: int) -> float:
        if prompt not in self._prefill_memo:
            self._prefill_memo[prompt] = prefill_seconds(self.costs, self.prefill, prompt, self.eff)
        return self._prefill_memo[prompt]

    def kv_bytes(self, tokens: int) -> float:
        return float(self.costs.kv.bytes_for(tokens))

    def exposed_s(self, prompt: int) -> float:
        return exposed_transfer_seconds(
            self.kv_bytes(prompt), self.remote_prefill_s(prompt), self.inputs.link, self.costs.model.num_layers
        )

    def remote_ttft_unqueued(self, prompt: int) -> float:
        return self.remote_prefill_s(prompt) + self.exposed_s(prompt)

    def local_ttft(self, prompt: int, slack: float) -> float:
        if slack <= 0:
            return math.inf
        return prefill_seconds(self.costs, self.decode, prompt, self.eff) / slack

    # ------------------------------------------------------------------ decode

    @cached_property
    def mean_context(self) -> int:
        """Mean tokens in context over a request's decode: its prompt plus half its output."""
        return round(sum(i + o / 2 for i, o in self.requests) / len(self.requests))

    @cached_property
    def mean_kv_read(self) -> float:
        return sum(self.kv_bytes(round(i + o / 2)) for i, o in self.requests) / len(self.requests)

    def step_s(self, batch: int, kv_read: float | None = None) -> float:
        read = batch * self.mean_kv_read if kv_read is None else kv_read
        if self.decode_memory is not None:
            return engine_step_seconds(
                self.costs,
                self.decode_memory,
                self.decode,
                batch,
                kv_bytes_read=read,
                mean_context=self.mean_context,
                eff=self.eff,
            )
        return decode_step_seconds(
            self.costs, self.decode, batch, kv_bytes_read=read, mean_context=self.mean_context, eff=self.eff
        )

    def decode_point(self) -> DecodePoint:
        """The largest batch at which the target share of requests meets the TPOT SLO and whose KV fits."""
        if self.decode_memory is not None:
            held = self.decode_memory.max_batch(round(sum(i + o for i, o in self.requests) / len(self.requests)))
        else:
            kv_room = self.decode.usable_memory - self.costs.weight_bytes
            peak_kv = max(sum(self.kv_bytes(i + o) for i, o in self.requests) / len(self.requests), 1.0)
            held = int(kv_room // peak_kv)
        fits = max(1, min(self.inputs.max_batch, held))
        low, high = 1, fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.tpot_attainment(mid) >= self.inputs.slo.target else (low, mid - 1)
        step = self.step_s(low)
        feasible = self.tpot_attainment(low) >= self.inputs.slo.target
        return DecodePoint(low, step, low / step, feasible, low == fits < self.inputs.max_batch)

    def tpot_attainment(self, batch: int) -> float:
        return sum(self.tpot_ok(batch, i, o) for i, o in self.requests) / len(self.requests)

    def slack(self, point: DecodePoint, replicas: int) -> float:
        """Share of a decode replica's time its running batch leaves free within the TPOT SLO."""
        wl = self.inputs.workload
        running = min(point.batch, max(1, math.ceil(wl.requests_per_second * wl.mean_output * point.step_s / replicas)))
        return max(0.0, 1 - self.step_s(running) / (self.inputs.slo.tpot_ms / 1e3))

    # ------------------------------------------------------------------ prefill queue

    def ttft_attainment(self, replicas: int, slack: float) -> float:
        """Share of requests predicted to meet the TTFT SLO with `replicas` prefill replicas (inf: no queueing)."""
        slo_s = self.inputs.slo.ttft_ms / 1e3
        remote = [i for i, _ in self.requests if self.is_remote(i)]
        rate = self.inputs.workload.requests_per_second * len(remote) / len(self.requests)
        service = [self.remote_prefill_s(i) for i in remote]
        rho, mean_wait = 0.0, 0.0
        if remote and replicas < MAX_REPLICAS:
            per_replica = rate / replicas
            rho = per_replica * sum(service) / len(service)
            if rho >= 1:
                return 0.0
            mean_wait = per_replica * sum(s * s for s in service) / len(service) / (2 * (1 - rho))
        ok = 0.0
        for prompt, _ in self.requests:
            if not self.is_remote(prompt):
                ok += float(self.local_ttft(prompt, slack) <= slo_s)
                continue
            budget = slo_s - self.remote_ttft_unqueued(prompt)
            if budget >= 0:
                ok += 1.0 if rho == 0 else 1 - rho * math.exp(-rho * budget / mean_wait)
        return ok / len(self.requests)

    def prefill_replicas(self, load: float, slack: float) -> int:
        if load == 0:
            return 0
        low = max(1, math.ceil(load * (1 + self.h)))
        target = self.inputs.slo.target
        if self.ttft_attainment(MAX_REPLICAS, slack) < target:
            return low
        high = low
        while self.ttft_attainment(high, slack) < target and high < MAX_REPLICAS:
            high = min(MAX_REPLICAS, high * 2)
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if self.ttft_attainment(mid, slack) >= target else (mid + 1, high)
        return low

    # ------------------------------------------------------------------ selective offload

    def offload_threshold(self, slack: float) -> int | None:
        """Shortest prompt from which remote prefill beats local prefill on TTFT, for every longer prompt too."""
        grid = sorted({16 * k for k in range(1, 129)} | {round(2048 * 1.03**j) for j in range(165)})
        threshold: int | None = None
        for prompt in reversed(grid):
            if self.remote_ttft_unqueued(prompt) > self.local_ttft(prompt, slack):
                break
            threshold = prompt
        return threshold

    # ------------------------------------------------------------------ the plan

    def plan(self) -> Plan:
        wl, n = self.inputs.workload, len(self.requests)
        remote = [i for i, _ in self.requests if self.is_remote(i)]
        local = [i for i, _ in self.requests if not self.is_remote(i)]
        rate = wl.requests_per_second
        prefill_load = rate / n * sum(self.remote_prefill_s(i) for i in remote)
        point = self.decode_point()
        local_busy = rate / n * sum(prefill_seconds(self.costs, self.decode, i, self.eff) for i in local)
        decode_load = rate * wl.mean_output / point.tokens_per_s + local_busy
        decode_replicas = max(1, math.ceil(decode_load * (1 + self.h)))
        slack = self.slack(point, decode_replicas)
        prefill_replicas = self.prefill_replicas(prefill_load, slack)
        ttft = self.ttft_attainment(prefill_replicas, slack)
        unqueued = self.ttft_attainment(MAX_REPLICAS, slack)
        tpot_ok = [self.tpot_ok(point.batch, i, o) for i, o in self.requests]
        planned_gbps = rate / n * sum(self.kv_bytes(i) for i in remote) * 8 / 1e9
        required = planned_gbps * (1 + self.h)
        link_ok = required <= self.inputs.link.effective_gbps
        return Plan(
            inputs=self.inputs,
            costs=self.costs,
            prefill=self.prefill,
            decode=self.decode,
            decode_point=point,
            prefill_replicas=prefill_replicas,
            decode_replicas=decode_replicas,
            prefill_load=prefill_load,
            decode_load=decode_load,
            remote_share=len(remote) / n,
            ttft_attainment=ttft,
            ttft_attainment_unqueued=unqueued,
            tpot_attainment=sum(tpot_ok) / n,
            goodput_rps=rate * ttft * (sum(tpot_ok) / n),
            planned_kv_gbps=planned_gbps,
            required_link_gbps=required,
            link_ok=link_ok,
            offload_threshold=self.offload_threshold(slack),
            reasons=tuple(self.misfits() + self.reasons(link_ok, required, unqueued, point)),
            context_tokens=self.context,
            prefill_memory=self.prefill_memory,
            decode_memory=self.decode_memory,
        )

    def tpot_ok(self, batch: int, prompt: int, output: int) -> bool:
        """This request's TPOT: a decode step at its full context among batch-mates of average context."""
        read = (batch - 1) * self.mean_kv_read + self.kv_bytes(prompt + output)
        return self.step_s(batch, read) <= self.inputs.slo.tpot_ms / 1e3

    def reasons(self, link_ok: bool, required: float, unqueued: float, point: DecodePoint) -> list[str]:
        out: list[str] = []
        link = self.inputs.link
        if not link_ok:
            out.append(
                f"link carries {link.effective_gbps:.3g} Gbit/s but the planned KV rate with "
                f"{self.inputs.headroom_pct:g} % headroom is {required:.3g} Gbit/s"
            )
        target = self.inputs.slo.target
        if unqueued < target:
            out.append(
                f"only {unqueued:.1%} of requests can meet the {self.inputs.slo.ttft_ms:g} ms TTFT SLO even without "
                f"queueing (target {target:.0%})"
            )
        if not point.tpot_feasible:
            out.append(
                f"even at batch 1 fewer than {target:.0%} of requests meet the {self.inputs.slo.tpot_ms:g} ms TPOT SLO "
                f"(a step takes {point.step_s * 1e3:.3g} ms)"
            )
        return out


def make_plan(inputs: PlanInputs) -> Plan:
    return Planner(inputs).plan()
