"""Local routing over the scheduler's table: version by weight, then decode and prefill by power of two choices.

Only instances of one version with one KV fingerprint are paired. Between table polls the gateway adds its own
in-flight counts to the load the instances last reported, so a burst does not pile onto one instance.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve.scheduler.protocol import RoutedInstance, RoutingTable


class NoRouteError(RuntimeError):
    """No ready instance can take this request; the message says what is missing."""


@dataclass(frozen=True)
class Plan:
    version: str
    decode: RoutedInstance
    prefill: RoutedInstance | None
    """None: the decode instance prefills the prompt itself."""
    reason: str
    """offload (short prompt), remote_prefill, colocated, or no_prefill_available"""


@dataclass
class Router:
    rng: random.Random = field(default_factory=random.Random)
    table: RoutingTable = field(default_factory=lambda: RoutingTable(generation=0, weights={}, instances=[]))
    inflight: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    pending_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    suspended_until: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    def suspend(self, instance_id: str, seconds: float) -> None:
        """Route nothing new to an instance that just failed, until the scheduler's view catches up."""
        self.suspended_until[instance_id] = self.clock() + seconds

    def suspended_ids(self) -> frozenset[str]:
        now = self.clock()
        return frozenset(i for i, until in self.suspended_until.items() if until > now)

    def plan(self, prompt_tokens: int, offload_threshold: int, exclude: frozenset[str] = frozenset()) -> Plan:
        """A route avoiding `exclude` and, while any other instance can serve, the suspended ones. When every one left
        is suspended they are routed to anyway (Envoy's panic mode): a suspension is a guess that an instance is
        failing, answering every request 503 until it lapses is certain to fail them."""
        suspended = self.suspended_ids() - exclude
        if suspended:
            try:
                return self._plan(prompt_tokens, offload_threshold, exclude | suspended)
            except NoRouteError:
                pass
        return self._plan(prompt_tokens, offload_threshold, exclude)

    def _plan(self, prompt_tokens: int, offload_threshold: int, exclude: frozenset[str]) -> Plan:
        instances = [i for i in self.table.instances if i.instance_id not in exclude]
        decodes = [i for i in instances if i.info.role in ("decode", "colocated")]
        version = self._pick_version({i.info.version for i in decodes})
        decodes = [d for d in decodes if d.info.version == version]
        if prompt_tokens < offload_threshold:
            return Plan(version, self.pick_decode(decodes), None, "offload")
        prefills = [i for i in instances if i.info.role == "prefill" and i.info.version == version]
        paired = [d for d in decodes if d.info.role == "decode" and self._compatible(prefills, d)]
        if not paired:
            reason = "colocated" if all(d.info.role == "colocated" for d in decodes) else "no_prefill_available"
            return Plan(version, self.pick_decode(decodes), None, reason)
        decode = self.pick_decode(paired)
        return Plan(
            version, decode, self._pick_prefill(self._compatible(prefills, decode), prompt_tokens), "remote_prefill"
        )

    @contextmanager
    def dispatched(self, instance: RoutedInstance, prompt_tokens: int = 0) -> Iterator[None]:
        """Count a request against an instance while it runs there."""
        self.inflight[instance.instance_id] += 1
        self.pending_tokens[instance.instance_id] += prompt_tokens
        try:
            yield
        finally:
            self.inflight[instance.instance_id] -= 1
            self.pending_tokens[instance.instance_id] -= prompt_tokens

    def _pick_version(self, versions: set[str]) -> str:
        if not versions:
            raise NoRouteError("no ready decode instance")
        weights = self.table.weights
        candidates = sorted(versions) if not weights else sorted(v for v in versions if _usable(weights.get(v, 0)))
        if not candidates:
            raise NoRouteError(f"no ready instance of a version with traffic weight (weights {weights})")
        chosen: str = self.rng.choices(candidates, weights=_finite_shares([weights.get(v, 1.0) for v in candidates]))[0]
        return chosen

    @staticmethod
    def _compatible(prefills: list[RoutedInstance], decode: RoutedInstance) -> list[RoutedInstance]:
        return [p for p in prefills if p.info.kv_fingerprint == decode.info.kv_fingerprint]

    def pick_decode(self, decodes: list[RoutedInstance]) -> RoutedInstance:
        if not decodes:
            raise NoRouteError("no ready decode instance")
        return self._two_choices(decodes, key=self._decode_headroom)

    def _pick_prefill(self, prefills: list[RoutedInstance], prompt_tokens: int) -> RoutedInstance:
        in_bucket = [
            p
            for p in prefills
            if p.info.min_prompt_tokens <= prompt_tokens
            and (p.info.max_prompt_tokens is None or prompt_tokens <= p.info.max_prompt_tokens)
        ]
        return self._two_choices(in_bucket or prefills, key=lambda p: -self._prefill_backlog(p))

    def _decode_headroom(self, decode: RoutedInstance) -> float:
        """Free fraction of the scarcer resource: request slots or KV memory. Higher is better."""
        load = decode.load
        busy = load.active_requests + load.queue_depth + self.inflight[decode.instance_id]
        free_slots = 1 - busy / load.max_concurrency
        free_kv = 1 - load.kv_utilisation()
        return min(free_slots, free_kv)

    def _prefill_backlog(self, prefill: RoutedInstance) -> int:
        return prefill.load.outstanding_prompt_tokens + self.pending_tokens[prefill.instance_id]

    def _two_choices(self, candidates: list[RoutedInstance], key: Callable[[RoutedInstance], float]) -> RoutedInstance:
        """Power of two choices: sample two, keep the better (ties broken by the sample order, which is random)."""
        if len(candidates) == 1:
            return candidates[0]
        first, second = self.rng.sample(candidates, 2)
        return first if key(first) >= key(second) else second


def _usable(weight: float) -> bool:
    return math.isfinite(weight) and weight > 0


def _finite_shares(weights: list[float]) -> list[float]:
    """The same proportions with a finite sum: weights near the float maximum overflow when random.choices adds
    them up, and whatever table the scheduler sends, routing must not fail on it."""
    largest = max(weights)
    return [w / largest for w in weights]


def alternative_decode(router: Router, failed: RoutedInstance, exclude: frozenset[str]) -> RoutedInstance | None:
    """Another ready instance that can decode the same KV: same role, version and fingerprint."""
    candidates = [
        i
        for i in router.table.instances
        if i.instance_id not in exclude
        and i.info.role == failed.info.role
        and i.info.version == failed.info.version
        and i.info.kv_fingerprint == failed.info.kv_fingerprint
    ]
    return router.pick_decode(candidates) if candidates else None
