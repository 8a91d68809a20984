"""The planner applied to stack files: which links must carry KV, and whether they can.

An environment's planned KV rate comes from its control stack: `capacity` (rate, mean input and output tokens,
headroom) and `serving` (the model, `offload_threshold_tokens`, `kv_streams`). The served model name is matched
against the built-in entries and their aliases (see models.match_builtin); failing that, a config.json at
`serving.model.path` on this machine is read. Otherwise the link check is skipped, and says why.
Lengths are taken as every request at the mean (capacity gives means only), so the remote share is all or none.
The rate divides evenly over the environment's prefill-decode links; each must carry its share with headroom.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdstack.model import DatacenterRole, Link, StackConfig
from pdstack.plan.kv import kv_footprint
from pdstack.plan.link import LinkSpec
from pdstack.plan.models import ModelError, ModelSpec, builtin_model, load_config_file, match_builtin
from pdstack.stacks.files import Problem, StackFile

PREFILL_ROLES = {DatacenterRole.PREFILL, DatacenterRole.MIXED}
DECODE_ROLES = {DatacenterRole.DECODE, DatacenterRole.MIXED}


@dataclass(frozen=True)
class LinkCheck:
    environment: str
    file: str
    path: str  # the field path of the link in `file`, or "" for an environment-wide skip
    link: str  # "dc-a -> dc-b"
    status: str  # "ok", "overloaded" or "skipped"
    reason: str
    required_gbps: float | None = None
    carries_gbps: float | None = None

    def as_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def control_of(stacks: list[StackFile]) -> StackFile | None:
    return next((s for s in stacks if s.config.datacenter.role is DatacenterRole.CONTROL), None)


def model_for(config: StackConfig) -> tuple[ModelSpec | None, str]:
    """The model a control stack serves, and how it was found (or why not)."""
    assert config.serving is not None
    served = config.serving.model
    builtin = match_builtin(served.name)
    if builtin is not None:
        return builtin_model(builtin), f"served name {served.name!r} matches built-in {builtin}"
    config_path = Path(served.path) / "config.json"
    if config_path.is_file():
        try:
            return load_config_file(config_path), f"read {config_path}"
        except ModelError as exc:
            return None, f"model {served.name!r}: {exc}"
    return None, (
        f"model {served.name!r} matches no built-in model and {config_path} is not on this machine: no link check"
    )


def kv_links(stacks: list[StackFile]) -> list[tuple[StackFile, int, Link]]:
    """Links joining a prefill-capable datacenter to a decode-capable one, each pair once (first declaration)."""
    roles = {s.config.datacenter.name: s.config.datacenter.role for s in stacks}
    seen: set[frozenset[str]] = set()
    found: list[tuple[StackFile, int, Link]] = []
    for stack in sorted(stacks, key=lambda s: str(s.path)):
        dc = stack.config.datacenter
        for i, link in enumerate(dc.links):
            pair = frozenset((dc.name, link.peer))
            peer_role = roles.get(link.peer)
            if pair in seen or peer_role is None:
                continue
            carries_kv = (dc.role in PREFILL_ROLES and peer_role in DECODE_ROLES) or (
                dc.role in DECODE_ROLES and peer_role in PREFILL_ROLES
            )
            if carries_kv and dc.name != link.peer:
                seen.add(pair)
                found.append((stack, i, link))
    return found


def planned_kv_gbps(model: ModelSpec, config: StackConfig) -> float:
    assert config.capacity is not None and config.serving is not None
    cap = config.capacity
    if cap.mean_input_tokens < config.serving.offload_threshold_tokens:
        return 0.0  # every prompt is shorter than the threshold: prefilled on decode, nothing crosses
    return cap.requests_per_second * kv_footprint(model).bytes_for(cap.mean_input_tokens) * 8 / 1e9


def environment_link_checks(stacks: list[StackFile]) -> list[LinkCheck]:
    env = str(stacks[0].config.environment)
    where = f"environment {env}"
    control = control_of(stacks)
    links = kv_links(stacks)
    if control is None or not links:
        return []
    cfg = control.config
    if cfg.capacity is None or cfg.serving is None:
        return [LinkCheck(env, where, "", "", "skipped", "no capacity in the control stack: no planned KV rate")]
    model, how = model_for(cfg)
    if model is None:
        return [LinkCheck(env, where, "", "", "skipped", how)]
    headroom = cfg.capacity.headroom_pct / 100
    share = planned_kv_gbps(model, cfg) / len(links)
    required = share * (1 + headroom)
    checks = []
    for stack, i, link in links:
        spec = LinkSpec(link.bandwidth_gbps, link.rtt_ms, link.loss_pct, cfg.serving.kv_streams)
        carries = spec.effective_gbps
        name = f"{stack.config.datacenter.name} -> {link.peer}"
        ok = required <= carries
        reason = (
            f"link {name} carries {carries:.3g} Gbit/s ({_carry_how(spec)}) but the planned KV rate is "
            f"{required:.3g} Gbit/s ({share:.3g} Gbit/s for {model.name} at {cfg.capacity.requests_per_second:g} "
            f"req/s x {cfg.capacity.mean_input_tokens} prompt tokens, + {cfg.capacity.headroom_pct:g} % headroom)"
        )
        if ok:
            reason = f"link {name} carries {carries:.3g} Gbit/s >= planned {required:.3g} Gbit/s; {how}"
        checks.append(
            LinkCheck(
                env,
                str(stack.path),
                f"pdstack:datacenter.links[{i}]",
                name,
                "ok" if ok else "overloaded",
                reason,
                required,
                carries,
            )
        )
    return checks


def _carry_how(spec: LinkSpec) -> str:
    ceiling = spec.mathis_gbps_per_stream
    if ceiling is None or spec.effective_gbps == spec.bandwidth_gbps:
        return f"its bandwidth_gbps {spec.bandwidth_gbps:g}"
    return (
        f"{spec.streams} kv_streams x TCP ceiling {ceiling:.3g} Gbit/s at rtt {spec.rtt_ms:g} ms and loss "
        f"{spec.loss_pct:g} %, under its bandwidth_gbps {spec.bandwidth_gbps:g}"
    )


def link_checks(stacks: list[StackFile]) -> list[LinkCheck]:
    by_env: dict[str, list[StackFile]] = {}
    for stack in stacks:
        by_env.setdefault(str(stack.config.environment), []).append(stack)
    return [check for env in sorted(by_env) for check in environment_link_checks(by_env[env])]


def link_problems(stacks: list[StackFile]) -> list[Problem]:
    """Validation errors: each cross-datacenter KV link that cannot carry the planned KV rate with headroom."""
    return [Problem(c.file, c.path, c.reason) for c in link_checks(stacks) if c.status == "overloaded"]
