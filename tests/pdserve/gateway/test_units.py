"""The gateway's decision logic in isolation: routing choices, rate limits in memory, keys files, validation."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
from pathlib import Path

import pytest

from pdserve.gateway.auth import KeysFileError, KeyStore, TenantLimits
from pdserve.gateway.early import streams_kv
from pdserve.gateway.metrics import field_label
from pdserve.gateway.ratelimit import RateLimiter
from pdserve.gateway.routing import NoRouteError, Plan, Router
from pdserve.scheduler.protocol import InstanceInfo, InstanceLoad, RoutedInstance, RoutingTable


def routed(instance_id: str, role: str, version: str = "v1", fingerprint: str = "fp1", **load: int) -> RoutedInstance:
    info = InstanceInfo(
        instance_id=instance_id,
        role=role,
        version=version,
        kv_fingerprint=fingerprint,  # type: ignore[arg-type]
        url=f"http://{instance_id}:1",
    )
    return RoutedInstance(
        instance_id=instance_id, state="ready", info=info, load=InstanceLoad(max_concurrency=10, **load)
    )


def router(*instances: RoutedInstance, weights: dict[str, float] | None = None) -> Router:
    return Router(
        rng=random.Random(7), table=RoutingTable(generation=1, weights=weights or {}, instances=list(instances))
    )


def test_only_fingerprint_compatible_pairs() -> None:
    r = router(
        routed("p-old", "prefill", fingerprint="fp-old"),
        routed("p-new", "prefill", fingerprint="fp-new"),
        routed("d-new", "decode", fingerprint="fp-new"),
    )
    for _ in range(50):
        plan = r.plan(prompt_tokens=100, offload_threshold=10)
        assert plan.prefill is not None and plan.prefill.instance_id == "p-new"


def test_no_compatible_prefill_means_decode_prefills_itself() -> None:
    r = router(routed("p", "prefill", fingerprint="other"), routed("d", "decode"))
    plan = r.plan(prompt_tokens=100, offload_threshold=10)
    assert plan.prefill is None and plan.reason == "no_prefill_available"


def test_short_prompts_are_offloaded() -> None:
    r = router(routed("p", "prefill"), routed("d", "decode"))
    assert r.plan(prompt_tokens=9, offload_threshold=10).prefill is None
    assert r.plan(prompt_tokens=10, offload_threshold=10).prefill is not None


def test_power_of_two_prefers_the_less_loaded() -> None:
    r = router(
        routed("d-busy", "decode", active_requests=9),
        routed("d-idle", "decode", active_requests=1),
        routed("p-busy", "prefill", outstanding_prompt_tokens=5000),
        routed("p-idle", "prefill"),
    )
    plans = [r.plan(prompt_tokens=100, offload_threshold=10) for _ in range(20)]
    assert {p.decode.instance_id for p in plans} == {"d-idle"}
    assert {p.prefill.instance_id for p in plans if p.prefill} == {"p-idle"}


def test_decode_kv_memory_counts_as_load() -> None:
    r = router(
        routed("d-full", "decode", kv_used_bytes=95, kv_capacity_bytes=100),
        routed("d-roomy", "decode", active_requests=5, kv_used_bytes=10, kv_capacity_bytes=100),
    )
    assert r.plan(prompt_tokens=1, offload_threshold=10).decode.instance_id == "d-roomy"


def test_in_flight_requests_spread_a_burst() -> None:
    r = router(routed("d1", "decode"), routed("d2", "decode"))
    first = r.plan(prompt_tokens=1, offload_threshold=10).decode
    with r.dispatched(first):
        assert r.plan(prompt_tokens=1, offload_threshold=10).decode.instance_id != first.instance_id


def test_prefill_length_buckets() -> None:
    short = routed("p-short", "prefill")
    short.info.max_prompt_tokens = 1000
    long = routed("p-long", "prefill", outstanding_prompt_tokens=99999)
    long.info.min_prompt_tokens = 1001
    r = router(short, long, routed("d", "decode"))
    assert r.plan(prompt_tokens=5000, offload_threshold=10).prefill.instance_id == "p-long"  # type: ignore[union-attr]
    assert r.plan(prompt_tokens=50, offload_threshold=10).prefill.instance_id == "p-short"  # type: ignore[union-attr]


def test_unweighted_versions_get_no_traffic_once_weights_are_set() -> None:
    instances = (routed("d1", "decode", version="v1"), routed("d2", "decode", version="v2"))
    unweighted, weighted = router(*instances), router(*instances, weights={"v2": 1})
    assert {unweighted.plan(1, 10).version for _ in range(40)} == {"v1", "v2"}
    assert {weighted.plan(1, 10).version for _ in range(40)} == {"v2"}
    with pytest.raises(NoRouteError, match="traffic weight"):
        router(*instances, weights={"v3": 1}).plan(1, 10)
    with pytest.raises(NoRouteError, match="no ready decode"):
        router(routed("p", "prefill")).plan(1, 10)


def test_suspended_instances_are_skipped() -> None:
    r = router(routed("d1", "decode"), routed("d2", "decode"))
    r.suspend("d1", 60)
    assert r.suspended_ids() == {"d1"}
    assert {r.plan(1, 10).decode.instance_id for _ in range(40)} == {"d2"}


def test_when_every_instance_is_suspended_they_are_routed_to_anyway() -> None:
    r = router(routed("p1", "prefill"), routed("d1", "decode"))
    r.suspend("d1", 60)
    r.suspend("p1", 60)
    plan = r.plan(100, 10)
    assert (plan.decode.instance_id, plan.prefill.instance_id if plan.prefill else None) == ("d1", "p1")
    with pytest.raises(NoRouteError):
        r.plan(100, 10, exclude=frozenset({"d1"}))  # an explicit exclusion (a failed attempt) still holds


def test_limits_refuse_then_name_the_limit_and_the_wait() -> None:
    async def scenario() -> None:
        limiter = RateLimiter(TenantLimits(requests_per_second=0.01, request_burst=2, tokens_per_minute=600), {})
        assert (await limiter.check("t", 10)).allowed and (await limiter.check("t", 10)).allowed
        refused = await limiter.check("t", 10)
        assert not refused.allowed and refused.limit == "requests" and refused.retry_after >= 1
        assert (await limiter.check("other-tenant", 500)).allowed
        starved = await limiter.check("other-tenant", 200)
        assert not starved.allowed and starved.limit == "tokens" and starved.retry_after >= 1
        assert (await limiter.check("other-tenant", 80)).allowed, "a refusal takes nothing from the budget"

    asyncio.run(scenario())


def test_tenant_overrides_default_limits(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(
        json.dumps({"a": ["key-a"], "b": {"keys": ["key-b"], "requests_per_second": 1, "request_burst": 1}})
    )
    keys = KeyStore.from_file(path)
    limiter = RateLimiter(
        TenantLimits(requests_per_second=100, request_burst=100, tokens_per_minute=10**6), keys.limits
    )

    async def scenario() -> None:
        assert (await limiter.check("b", 1)).allowed and not (await limiter.check("b", 1)).allowed
        assert all([(await limiter.check("a", 1)).allowed for _ in range(50)])

    asyncio.run(scenario())


def test_keys_file_digests_and_plaintext(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    digest = hashlib.sha256(b"secret-one").hexdigest()
    path.write_text(f"acme:\n  - sha256:{digest}\n  - plain-two\n")
    keys = KeyStore.from_file(path)
    assert keys.tenant_for("Bearer secret-one") == "acme"
    assert keys.tenant_for("Bearer plain-two") == "acme"
    assert keys.tenant_for(f"Bearer sha256:{digest}") is None, "a digest is not itself a key"
    assert keys.tenant_for("Bearer nope") is None and keys.tenant_for(None) is None
    assert keys.tenant_for("Basic secret-one") is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"acme": []}', "tenant 'acme': keys"),
        ('{"acme": {"keys": ["k"], "requests_per_second": -1}}', "tenant 'acme': requests_per_second"),
        ("[]", "mapping tenant -> keys"),
    ],
)
def test_bad_keys_files_name_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(KeysFileError, match=message.replace("(", r"\(")):
        KeyStore.from_file(path)


def test_early_dispatch_only_when_both_ends_stream_kv() -> None:
    def plan(prefill_streams: bool, decode_streams: bool, kv_port: int | None = 14600) -> Plan:
        prefill, decode = routed("p", "prefill"), routed("d", "decode")
        prefill.info.kv_streaming, prefill.info.kv_host, prefill.info.kv_port = prefill_streams, "10.0.0.1", kv_port
        decode.info.kv_streaming = decode_streams
        return Plan("v1", decode, prefill, "remote_prefill")

    assert streams_kv(plan(True, True))
    assert not streams_kv(plan(True, False)) and not streams_kv(plan(False, True))
    assert not streams_kv(plan(True, True, kv_port=None)), "no registered KV endpoint to name"
    offload = plan(True, True)
    assert not streams_kv(Plan("v1", offload.decode, None, "offload"))


@pytest.mark.parametrize(
    "weights",
    [
        {"v1": 1e308, "v2": 1e308},
        {"v1": float("inf"), "v2": 1.0},
        {"v1": float("nan"), "v2": 1.0},
        {"v1": 5e-324, "v2": 1e308},
    ],
)
def test_routing_survives_any_weights_table(weights: dict[str, float]) -> None:
    """Finding 6: weights whose sum overflows (or that are not finite) never fail routing; versions whose weight is
    usable (finite, above 0) are chosen, in proportion."""
    instances = (routed("d1", "decode", version="v1"), routed("d2", "decode", version="v2"))
    r = router(*instances, weights=weights)
    chosen = {r.plan(1, 10).version for _ in range(200)}
    usable = {v for v, w in weights.items() if math.isfinite(w) and w > 0}
    assert chosen <= usable and chosen
    with pytest.raises(NoRouteError, match="traffic weight"):
        router(*instances, weights={"v1": float("nan"), "v2": float("inf")}).plan(1, 10)


def test_even_weights_near_the_float_maximum_split_traffic() -> None:
    instances = (routed("d1", "decode", version="v1"), routed("d2", "decode", version="v2"))
    r = router(*instances, weights={"v1": 1e308, "v2": 1e308})
    assert {r.plan(1, 10).version for _ in range(60)} == {"v1", "v2"}


def test_spent_limits_are_known_before_the_body_and_take_nothing() -> None:
    """Finding 9: `spent` tells a tenant over its limit before its body is read, and takes nothing itself."""

    async def scenario() -> None:
        limiter = RateLimiter(TenantLimits(requests_per_second=0.01, request_burst=2, tokens_per_minute=600), {})
        for _ in range(5):
            assert (await limiter.spent("t")).allowed
        assert (await limiter.check("t", 10)).allowed and (await limiter.check("t", 10)).allowed
        spent = await limiter.spent("t")
        assert not spent.allowed and spent.limit == "requests" and spent.retry_after >= 1
        assert (await limiter.check("rich", 600)).allowed
        assert (await limiter.spent("rich")).limit == "tokens"

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("field", "label"),
    [
        ("stop", "stop"),
        ("messages[3].content", "messages"),
        ("stream_options.include_usage", "stream_options"),
        ("x" * 30_000, "other"),
        ("x" * 30_000 + ".stop", "other"),
        ("presence_penalty", "presence_penalty"),
        ("body", "body"),
    ],
)
def test_refused_fields_become_labels_from_a_fixed_set(field: str, label: str) -> None:
    """Finding 2: a field named by a client's JSON key never becomes a label value."""
    assert field_label(field) == label


def test_a_tenants_concurrency_cap_comes_from_its_keys_entry_or_the_default(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"a": ["key-a"], "b": {"keys": ["key-b"], "max_concurrent_requests": 3}}))
    keys = KeyStore.from_file(path)
    defaults = TenantLimits(requests_per_second=1, request_burst=1, tokens_per_minute=1, max_concurrent_requests=128)
    limiter = RateLimiter(defaults, keys.limits)
    assert (limiter.concurrency_cap("a"), limiter.concurrency_cap("b")) == (128, 3)
    path.write_text(json.dumps({"c": {"keys": ["key-c"], "max_concurrent_requests": 0}}))
    with pytest.raises(KeysFileError, match="max_concurrent_requests"):
        KeyStore.from_file(path)
