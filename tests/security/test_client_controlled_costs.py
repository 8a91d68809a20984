"""Issue 33: what a client (or a holder of a lesser credential) could make the stack spend or keep, on real processes.

- client strings as metric labels: 30 KB paths and JSON keys must not grow /metrics (finding 2);
- stop strings bounded in number and length, on the gateway and the servers (finding 3);
- what decode would refuse is refused before prefill runs, and KV that no decode will pull is released at once
  (finding 5);
- colocated servers without a token stay on loopback (finding 7); body limits on servers (finding 8);
- a tenant over its limit is refused before its body is read, and its concurrent requests are capped (finding 9);
- parameters pdserve's engine would ignore are refused by name, and every 400 names its field (finding 11).

Every answer is checked by check_answer (no 5xx, no traceback) and tallied; the stack ends idle.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.scheduler.client import bearer
from tests.support.cluster import KEYS, Cluster, metric, wait_for
from tests.support.services import Service, identity_key_file, principal_token, start_scheduler

from .fuzzing import check_answer
from .serving_stack import AUTH, NORMAL, normal_completion, pd_stack
from .test_fuzz_endpoints import assert_idle

CONCURRENT_CAP = 8
DECODE_DELAY_MS = 5000  # far longer than a client needs to see prefill served and leave
FLOOD = 100  # requests per flood: bounded in count; each is refused at once
FLOOD_RSS_MIB = 24  # what reading (and refusing) 64-150 MiB of bodies may add to a process: a fraction of them
LABEL_GROWTH_BYTES = 4096  # a handful of new series at most (a status, `other`), never one per request
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank at dawn"  # >= 8 tokens: remote prefill
TALLY: Counter[str] = Counter()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, dense_checkpoint: Path) -> Iterator[Cluster]:
    env = {"PDSERVE_TENANT_MAX_CONCURRENT_REQUESTS": str(CONCURRENT_CAP)}
    with pd_stack(tmp_path_factory.mktemp("client-costs"), kv_key_file, dense_checkpoint, env) as cluster:
        yield cluster
    print(f"\nissue 33 answers: {dict(TALLY)}")


def checked(response: httpx.Response, what: str, status: int | None = None, param: str | None = None) -> None:
    check_answer(response, what)
    TALLY["5xx" if response.status_code >= 500 else f"{response.status_code // 100}xx"] += 1
    if status is not None:
        assert response.status_code == status, f"{what}: {response.status_code} {response.text[:300]}"
    if param is not None:
        assert response.json()["error"]["param"] == param, f"{what}: {response.text[:300]}"


def metrics_size(url: str, headers: dict[str, str] | None = None) -> int:
    return len(httpx.get(f"{url}/metrics", headers=headers or {}, timeout=30).content)


def rss_mib(service: Service) -> float:
    assert service.process is not None
    status = Path(f"/proc/{service.process.pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def open_fds(service: Service) -> int:
    assert service.process is not None
    return len(list(Path(f"/proc/{service.process.pid}/fd").iterdir()))


def leases(cluster: Cluster, name: str = "p") -> float:
    return metric(httpx.get(f"{cluster.servers[name].url}/metrics").text, "pdserve_kv_leases")


# -- finding 2 ---------------------------------------------------------------------------------------------------------


def test_unauthenticated_long_paths_do_not_grow_a_servers_metrics(cluster: Cluster) -> None:
    decode = cluster.servers["d"]
    before = metrics_size(decode.url)
    with httpx.Client(timeout=30) as client:
        for _ in range(FLOOD):
            path = "/v1/" + secrets.token_hex(15_000)  # 30 KB, under the 64 KiB header cap
            checked(client.get(decode.url + path), "decode long path", status=401)
    assert metrics_size(decode.url) - before < LABEL_GROWTH_BYTES


def test_client_json_keys_do_not_grow_the_gateways_metrics(cluster: Cluster) -> None:
    """The finding's bodies, `{"<30 KB key>": NaN}`, from a tenant within its limits (400 naming the key) and from
    one over them (429 before the body is read)."""
    gateway = cluster.gateways[0].url
    scarce = {"Authorization": f"Bearer {KEYS['scarce']}"}
    for _ in range(3):  # the scarce tenant's whole burst
        checked(httpx.post(gateway + "/v1/completions", json=NORMAL, headers=scarce, timeout=60), "burst", status=200)
    before = metrics_size(gateway)
    with httpx.Client(timeout=30) as client:
        for index in range(FLOOD):
            key = secrets.token_hex(15_000)
            body = ('{"' + key + '": NaN}').encode()
            headers = {**(AUTH if index % 2 else scarce), "Content-Type": "application/json"}
            answer = client.post(gateway + "/v1/completions", content=body, headers=headers)
            checked(answer, "gateway long key", status=400 if index % 2 else 429)
    assert metrics_size(gateway) - before < LABEL_GROWTH_BYTES
    text = httpx.get(gateway + "/metrics").text
    assert metric(text, "pdserve_gateway_invalid_requests_total", field="other") >= FLOOD // 2


# -- finding 3 ---------------------------------------------------------------------------------------------------------

LONG_STOPS = ["x" * 250_000] * 4


@pytest.mark.parametrize(
    "stop",
    [LONG_STOPS, ["a" * 257], ["a", "b", "c", "d", "e"], [""], "y" * 1000],
    ids=["250k", "257", "5", "empty", "str"],
)
def test_stop_strings_are_bounded_everywhere(cluster: Cluster, stop: Any) -> None:
    body = {**NORMAL, "stop": stop}
    checked(
        httpx.post(cluster.gateways[0].url + "/v1/completions", json=body, headers=AUTH, timeout=60),
        "gateway stop",
        status=400,
        param="stop",
    )
    for name in ("p", "d"):
        answer = httpx.post(cluster.servers[name].url + "/v1/completions", json=body, headers=cluster.server_auth())
        checked(answer, f"{name} stop", status=400, param="stop")


def test_stop_strings_at_the_limit_are_served(cluster: Cluster) -> None:
    body = {**NORMAL, "prompt": LONG_PROMPT, "stop": ["z" * 256, "q" * 256, "w" * 255 + "v", "k" * 256]}
    answer = httpx.post(cluster.gateways[0].url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    checked(answer, "stops at the limit", status=200)


# -- finding 5 (the part every stack shows: refused before prefill) ----------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": "x"}, "min_tokens"),
        ({"min_tokens": 1000}, "min_tokens"),
        ({"stream": True, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"top_k": "5"}, "top_k"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"suffix": "tail"}, "suffix"),
    ],
)
def test_what_decode_would_refuse_costs_no_prefill(cluster: Cluster, extra: dict[str, Any], param: str) -> None:
    served = cluster.served("p")
    body = {**NORMAL, "prompt": LONG_PROMPT, **extra}
    answer = httpx.post(cluster.gateways[0].url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    checked(answer, f"gateway {extra}", status=400, param=param)
    assert cluster.served("p") == served, "prefill ran for a request the gateway refused"
    assert leases(cluster) == 0


# -- finding 5: KV that no decode will pull is released at once --------------------------------------------------------


@pytest.fixture(scope="module")
def refusing_decode(
    tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, dense_checkpoint: Path
) -> Iterator[Cluster]:
    """Prefill with a 300 s lease, and a decode that refuses bodies over 1 KiB: a request padded past that passes
    the gateway and prefill, and then decode refuses it (413) with its KV leased on prefill. Decode waits
    DECODE_DELAY_MS before each request it accepts, so a client can leave after prefill and before decode starts."""
    cluster = Cluster(tmp_path_factory.mktemp("refusing-decode"), kv_key_file)
    try:
        cluster.start_scheduler()
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PDSERVE_KV_LEASE_SECONDS", "300")
            cluster.launch_server("p", "prefill", dense_checkpoint)
            patch.delenv("PDSERVE_KV_LEASE_SECONDS")
            patch.setenv("PDSERVE_MAX_BODY_BYTES", "1024")
            patch.setenv("PDSERVE_FAULT_DELAY_MS", str(DECODE_DELAY_MS))
            cluster.launch_server("d", "decode", dense_checkpoint)
        cluster.wait_servers()
        model = dense_checkpoint / "tokenizer.json"
        gateway = cluster.start_gateway("--tokenizer-file", str(model), "--offload-threshold-tokens", "8")
        cluster.wait_routable(gateway, 2)
        yield cluster
    finally:
        cluster.stop()


def test_kv_that_decode_refused_is_released_at_once(refusing_decode: Cluster) -> None:
    cluster, gateway = refusing_decode, refusing_decode.gateways[0].url
    body = {**NORMAL, "prompt": LONG_PROMPT, "user": "u" * 1500}  # `user` is passed on and ignored
    for attempt in range(3):
        answer = httpx.post(gateway + "/v1/completions", json=body, headers=AUTH, timeout=60)
        checked(answer, f"refused by decode {attempt}", status=413)
    assert cluster.served("p") == 3, "prefill ran and leased the KV each time"
    wait_for(
        lambda: (
            metric(httpx.get(gateway + "/metrics").text, "pdserve_gateway_kv_releases_total", outcome="released") == 3
        ),
        timeout=30,
        what="three releases",
    )
    text = httpx.get(cluster.servers["p"].url + "/metrics").text
    assert metric(text, "pdserve_kv_leases_unused_total", outcome="released") == 3
    assert metric(text, "pdserve_kv_leases") == 0, "the 300 s leases are gone: released, not expired"
    short = {**NORMAL, "prompt": LONG_PROMPT}
    checked(httpx.post(gateway + "/v1/completions", json=short, headers=AUTH, timeout=60), "normal", status=200)


def test_kv_of_a_client_gone_before_decode_started_is_released(refusing_decode: Cluster) -> None:
    cluster, gateway = refusing_decode, refusing_decode.gateways[0].url
    released = releases(gateway)
    served = cluster.served("p")
    body = json.dumps({**NORMAL, "prompt": LONG_PROMPT}).encode()
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        wait_for(lambda: cluster.served("p") > served, timeout=60, what="prefill's answer")
    wait_for(lambda: releases(gateway) > released, timeout=30, what="the release of the abandoned KV")
    wait_for(lambda: leases(cluster) == 0, timeout=30, what="no lease left (they last 300 s)")
    assert metric(httpx.get(gateway + "/metrics").text, "pdserve_gateway_client_disconnects_total") >= 1


def releases(gateway: str) -> float:
    return metric(httpx.get(gateway + "/metrics").text, "pdserve_gateway_kv_releases_total", outcome="released")


def test_the_release_endpoint_needs_the_server_token_and_a_lease_id(refusing_decode: Cluster) -> None:
    url = refusing_decode.servers["p"].url + "/v1/kv/release"
    checked(httpx.post(url, json={"remote_request_id": "x"}, timeout=30), "release without token", status=401)
    auth = refusing_decode.server_auth()
    for bad in ({}, {"remote_request_id": 5}, {"remote_request_id": "x" * 300}, []):
        checked(
            httpx.post(url, json=bad, headers=auth, timeout=30),
            f"release {bad}",
            status=400,
            param="remote_request_id" if isinstance(bad, dict) else "body",
        )
    answer = httpx.post(url, json={"remote_request_id": "never-leased"}, headers=auth, timeout=30)
    checked(answer, "release unknown", status=200)
    assert answer.json()["released"] is False
    decode = refusing_decode.servers["d"].url + "/v1/kv/release"
    checked(
        httpx.post(decode, json={"remote_request_id": "x"}, headers=auth, timeout=30),
        "decode release",
        status=404,
        param="path",
    )


# -- findings 4, 6 and 8 on the scheduler ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str, Path]]:
    tmp = tmp_path_factory.mktemp("client-costs-scheduler")
    service, admin = start_scheduler(tmp)
    try:
        yield service, admin, tmp
    finally:
        service.stop()


def test_a_token_derived_for_admin_is_no_admin(scheduler: tuple[Service, str, Path]) -> None:
    service, admin, tmp = scheduler
    key = identity_key_file(tmp).read_text().strip()
    mac = hmac.new(key.encode(), b"pdstack-scheduler-principal\0admin", hashlib.sha256).hexdigest()
    forged = bearer(f"pds1.admin.{mac}")
    info = {"instance_id": "anything", "role": "decode", "version": "v1", "kv_fingerprint": "f", "url": "http://x:1"}
    verdict = {"canary": "v2", "baseline": "v1", "step_percent": 10, "outcome": "pass"}
    for method, path, body in (
        ("PUT", "/v1/admin/weights", {"weights": {"v9": 1}}),
        ("POST", "/v1/admin/canary/verdicts", verdict),
        ("POST", "/v1/instances", info),
        ("DELETE", "/v1/instances/anything", None),
    ):
        answer = httpx.request(method, service.url + path, json=body, headers=forged, timeout=30)
        checked(answer, f"forged admin {method} {path}", status=401)
    assert httpx.get(service.url + "/v1/admin/weights", headers=bearer(admin)).json()["weights"] == {}


def test_overflowing_weights_and_huge_bodies_are_refused(scheduler: tuple[Service, str, Path]) -> None:
    service, admin, tmp = scheduler
    url = service.url + "/v1/admin/weights"
    for weights in ({"v1": 1e308, "v2": 1e308}, {"v1": 1e308, "v2": 1e308, "v3": 1e308}):
        answer = httpx.put(url, json={"weights": weights}, headers=bearer(admin), timeout=30)
        checked(answer, f"weights {weights}", status=400)
        assert answer.json()["error"]["field"] == "weights"
    before = rss_mib(service)
    beat = service.url + "/v1/instances/flooder/heartbeat"
    for target, method, auth in (
        (url, "PUT", bearer(admin)),
        (beat, "POST", bearer(principal_token(tmp, "instance:flooder"))),
    ):
        huge = httpx.request(method, target, content=b" " * (64 << 20), headers=auth, timeout=60)
        checked(huge, f"64 MiB body to {target}", status=413)
        assert huge.json()["error"]["field"] == "body"
    grown = rss_mib(service) - before
    print(f"\nscheduler RSS across two 64 MiB bodies: {before:.1f} -> {before + grown:.1f} MiB")
    assert grown < FLOOD_RSS_MIB, f"the scheduler's RSS grew {grown:.1f} MiB reading bodies it refuses"
    assert httpx.get(url, headers=bearer(admin)).json()["weights"] == {}


# -- finding 8 ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["p", "d"])
def test_servers_refuse_bodies_over_their_limit(cluster: Cluster, name: str) -> None:
    url = cluster.servers[name].url + "/v1/completions"

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(96):  # 6 MiB, no Content-Length: refused once past the 4 MiB default
            yield b"a" * 65536
        yield b'"}'

    declared = httpx.post(url, content=b" " * (5 << 20), headers=cluster.server_auth(), timeout=60)
    checked(declared, f"{name} declared body", status=413, param="body")
    checked(
        httpx.post(url, content=chunks(), headers=cluster.server_auth(), timeout=60),
        f"{name} streamed body",
        status=413,
        param="body",
    )


# -- finding 9 ---------------------------------------------------------------------------------------------------------


def open_partial(url: str, key: str, declared: int = 1 << 20) -> socket.socket:
    """A request whose headers are complete and whose body is 1 KiB of the `declared` bytes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    )
    sock.sendall(head.encode() + b"{" + b" " * 1023)
    return sock


def status_of(sock: socket.socket) -> int:
    answer = sock.recv(65536)
    return int(answer.split(b" ", 2)[1])


def test_a_tenant_over_its_limit_is_refused_before_its_body(cluster: Cluster) -> None:
    """The scarce tenant spent its burst above: each of 150 partial 1 MiB bodies is answered 429 at once, unread;
    the gateway holds no body for them (its RSS barely moves while they stay open) and no descriptor after."""
    service = cluster.gateways[0]
    rss, fds = rss_mib(service), open_fds(service)
    held = [open_partial(service.url, KEYS["scarce"]) for _ in range(150)]
    try:
        for sock in held:
            status = status_of(sock)
            TALLY[f"{status // 100}xx"] += 1
            assert status == 429
        grown = rss_mib(service) - rss
        print(
            f"\ngateway with 150 refused 1 MiB bodies open: RSS {rss:.1f} -> {rss + grown:.1f} MiB, "
            f"descriptors {fds} -> {open_fds(service)}"
        )
        assert grown < FLOOD_RSS_MIB, f"the gateway's RSS grew {grown:.1f} MiB for bodies it refused"
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: open_fds(service) <= fds + 2, timeout=30, what="the gateway's descriptors given back")


def test_a_tenants_concurrent_requests_are_capped(cluster: Cluster) -> None:
    gateway = cluster.gateways[0].url
    held = [open_partial(gateway, KEYS["bulk"]) for _ in range(CONCURRENT_CAP)]
    try:
        wait_for(
            lambda: metric(httpx.get(gateway + "/metrics").text, "pdserve_gateway_inflight_requests") >= CONCURRENT_CAP,
            timeout=30,
            what="the held requests in flight",
        )
        refused = httpx.post(gateway + "/v1/completions", json=NORMAL, headers=AUTH, timeout=60)
        checked(refused, "over the concurrency cap", status=429)
        assert "concurrency" in refused.json()["error"]["message"]
        other = {"Authorization": f"Bearer {KEYS['acme']}"}
        checked(
            httpx.post(gateway + "/v1/completions", json=NORMAL, headers=other, timeout=60),
            "another tenant",
            status=200,
        )
    finally:
        for sock in held:
            sock.close()
    wait_for(lambda: normal_completion(gateway).status_code == 200, timeout=60, what="the cap given back")
    assert metric(httpx.get(gateway + "/metrics").text, "pdserve_gateway_rate_limited_total", limit="concurrency") >= 1


# -- finding 11 --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["null", "[]", "123", '"text"'])
@pytest.mark.parametrize("name", ["p", "d"])
def test_non_object_bodies_name_the_body(cluster: Cluster, raw: str, name: str) -> None:
    headers = {**cluster.server_auth(), "Content-Type": "application/json"}
    answer = httpx.post(cluster.servers[name].url + "/v1/completions", content=raw, headers=headers, timeout=30)
    checked(answer, f"{name} body {raw}", status=400, param="body")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 1.5}, "presence_penalty"),
        ({"suffix": "s"}, "suffix"),
    ],
)
def test_ignored_parameters_are_refused_by_the_servers(cluster: Cluster, extra: dict[str, Any], param: str) -> None:
    body = {**NORMAL, **extra}
    for name in ("p", "d"):
        answer = httpx.post(cluster.servers[name].url + "/v1/completions", json=body, headers=cluster.server_auth())
        checked(answer, f"{name} {extra}", status=400, param=param)


# -- finding 7 ---------------------------------------------------------------------------------------------------------


def test_a_colocated_server_without_a_token_stays_on_loopback(dense_checkpoint: Path) -> None:
    for host in ("0.0.0.0", "::"):
        started = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "colocated", "--model", str(dense_checkpoint), "--host", host],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert started.returncode != 0
        assert "api_token_file" in started.stderr and host in started.stderr, started.stderr[-500:]


# -- the end -----------------------------------------------------------------------------------------------------------


def test_the_stack_is_idle_and_serves_after_all_this(cluster: Cluster) -> None:
    assert_idle(cluster)
    assert leases(cluster) == 0
    assert normal_completion(cluster.gateways[0].url).status_code == 200
    assert TALLY["5xx"] == 0
