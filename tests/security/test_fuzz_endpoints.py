"""Hypothesis-driven fuzzing of every public HTTP endpoint of the gateway, the model servers and the scheduler, on
real processes (one stack for the module: scheduler, prefill, decode, gateway; the scheduler's write endpoints get a
scheduler of their own, so junk registrations cannot reach the gateway's routing).

Every answer: no 5xx, no traceback text. Afterwards: every gateway request was counted in
pdserve_gateway_requests_total and logged under its X-Request-Id, the gateway's in-flight gauge and the servers'
admission gauges are back to zero, and a normal completion still succeeds.
"""

from __future__ import annotations

import itertools
import json
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.cluster import Cluster, metric, wait_for
from tests.support.services import Service, start_scheduler

from .fuzzing import (
    CONTENT_TYPES,
    FUZZ,
    HEADER_VALUES,
    PATHS,
    VALUES,
    check_answer,
    completion_bodies,
    encode,
    kv_params,
)
from .serving_stack import AUTH, NORMAL, normal_completion, pd_stack

COMPLETION = {
    "model": "dense",
    "prompt": "The quick brown fox jumps over the lazy dog",
    "max_tokens": 4,
    "temperature": 0,
}
CHAT = {"model": "dense", "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 4, "temperature": 0}
BASES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
ADMISSION_GAUGES = ("pdserve_admitted_requests", "pdserve_running_requests", "pdserve_kv_memory_reserved_bytes")
IDS = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, kv_key_file: Path, dense_checkpoint: Path) -> Iterator[Cluster]:
    with pd_stack(tmp_path_factory.mktemp("fuzz"), kv_key_file, dense_checkpoint) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def scratch_scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, str]]:
    service, admin = start_scheduler(tmp_path_factory.mktemp("fuzz-scheduler"))
    try:
        yield service, admin
    finally:
        service.stop()


def request_id() -> str:
    return f"fuzz-{next(IDS):06d}"


def send(client: httpx.Client, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> httpx.Response:
    return client.request(method, url, content=body, headers=headers)


def counted(cluster: Cluster) -> float:
    return metric(httpx.get(f"{cluster.gateways[0].url}/metrics").text, "pdserve_gateway_requests_total")


def assert_idle(cluster: Cluster) -> None:
    """The gateway's in-flight gauge and every server's admission gauges back to zero (streams end asynchronously,
    so this waits a bounded while)."""
    gateway = cluster.gateways[0].url

    def idle() -> bool:
        if metric(httpx.get(f"{gateway}/metrics").text, "pdserve_gateway_inflight_requests") != 0:
            return False
        for server in cluster.servers.values():
            text = httpx.get(f"{server.url}/metrics", headers=cluster.server_auth()).text
            if any(metric(text, name) != 0 for name in ADMISSION_GAUGES):
                return False
        return True

    wait_for(idle, timeout=30, what="gateway in-flight and server admission gauges at zero")


def assert_logged(service: Service, ids: list[str]) -> None:
    logged = set()
    for line in service.logs().splitlines():
        if line.startswith("{"):
            logged.add(json.loads(line).get("request_id"))
    missing = [i for i in ids if i not in logged]
    assert not missing, f"{len(missing)} of {len(ids)} requests have no log line, e.g. {missing[:3]}"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_gateway_completions(cluster: Cluster, path: str) -> None:
    gateway = cluster.gateways[0]
    before, sent, statuses = counted(cluster), [], Counter[int]()
    with httpx.Client(timeout=60) as client:

        @FUZZ
        @given(body=completion_bodies(BASES[path]), content_type=CONTENT_TYPES)
        def attack(body: bytes, content_type: str) -> None:
            rid = request_id()
            sent.append(rid)
            headers = {**AUTH, "X-Request-Id": rid, "Content-Type": content_type}
            answer = send(client, "POST", gateway.url + path, body, headers)
            check_answer(answer, f"gateway {path} {body[:200]!r}")
            statuses[answer.status_code] += 1

        attack()
    assert statuses[200] and statuses[400], f"the fuzzing should both pass and fail validation: {statuses}"
    assert counted(cluster) - before == len(sent)
    assert_logged(gateway, sent)
    assert_idle(cluster)
    assert normal_completion(gateway.url).status_code == 200


def test_gateway_paths_methods_and_headers(cluster: Cluster) -> None:
    """Unknown paths, wrong methods and odd headers (keys, request ids) on the gateway: 4xx, counted, no leak."""
    gateway = cluster.gateways[0]
    before, sent = counted(cluster), []
    with httpx.Client(timeout=60) as client:

        @FUZZ
        @given(
            path=st.one_of(PATHS, st.sampled_from(["/v1/models", "/v1/completions"])),
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
            authorization=st.one_of(st.just(AUTH["Authorization"]), HEADER_VALUES.map(lambda v: f"Bearer {v}".strip())),
            incoming_id=st.one_of(st.none(), HEADER_VALUES),
        )
        def attack(path: str, method: str, authorization: str, incoming_id: str | None) -> None:
            rid = request_id()
            headers = {"Authorization": authorization, "X-Request-Id": incoming_id if incoming_id is not None else rid}
            answer = send(client, method, gateway.url + path, encode(COMPLETION) if method != "GET" else None, headers)
            check_answer(answer, f"gateway {method} {path}")
            if not path.startswith(("/health", "/metrics")):
                sent.append(answer.headers.get("x-request-id", ""))

        attack()
    assert counted(cluster) - before == len(sent)
    assert_logged(gateway, [i for i in sent if i])
    assert_idle(cluster)


@pytest.mark.parametrize(
    ("role", "path"), [("p", "/v1/completions"), ("d", "/v1/completions"), ("d", "/v1/chat/completions")]
)
def test_server_completions(cluster: Cluster, role: str, path: str) -> None:
    """Straight to a model server holding its API token (the gateway's view of it): hostile bodies, forged
    kv_transfer_params included, never a 5xx and never a leaked slot."""
    server = cluster.servers[role]
    statuses = Counter[int]()
    with httpx.Client(timeout=60) as client:

        @FUZZ
        @given(body=completion_bodies(BASES[path]), content_type=CONTENT_TYPES, authorized=st.booleans())
        def attack(body: bytes, content_type: str, authorized: bool) -> None:
            headers = {
                "Content-Type": content_type,
                "X-Request-Id": request_id(),
                **(cluster.server_auth() if authorized else {"Authorization": "Bearer wrong"}),
            }
            answer = send(client, "POST", server.url + path, body, headers)
            check_answer(answer, f"{role} {path} {body[:200]!r}")
            statuses[answer.status_code] += 1
            if not authorized:
                assert answer.status_code == 401

        attack()
    assert statuses[400] and statuses[401], statuses
    assert_idle(cluster)
    assert normal_completion(cluster.gateways[0].url).status_code == 200


def test_forged_kv_transfer_params_never_make_decode_connect(cluster: Cluster) -> None:
    """Finding 2 from the decode side: whatever kv_transfer_params a caller holding the server token writes, decode
    connects nowhere it names (a listening trap on loopback accepts no connection)."""
    decode = cluster.servers["d"]
    with socket.socket() as trap, httpx.Client(timeout=60) as client:
        trap.bind(("127.0.0.1", 0))
        trap.listen(64)
        trap.setblocking(False)
        port = trap.getsockname()[1]

        @FUZZ
        @given(params=kv_params(), prompt=st.sampled_from(["Hi", COMPLETION["prompt"]]))
        def attack(params: dict[str, Any], prompt: str) -> None:
            params.update(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port)
            body = encode({**COMPLETION, "prompt": prompt, "kv_transfer_params": params})
            headers = {**cluster.server_auth(), "Content-Type": "application/json"}
            answer = send(client, "POST", decode.url + "/v1/completions", body, headers)
            check_answer(answer, f"decode {body[:200]!r}")
            assert answer.status_code == 400, answer.text

        attack()
        with pytest.raises(BlockingIOError):
            trap.accept()
    assert_idle(cluster)


def test_negative_seeds_leak_no_slot(cluster: Cluster) -> None:
    """Finding 1: more seed=-1 requests than the servers have slots, straight to decode and through the gateway;
    then a normal request is served and nothing stays admitted."""
    decode = cluster.servers["d"]
    slots = 64  # the servers' default --max-num-seqs
    with httpx.Client(timeout=60) as client:
        for _ in range(slots + 8):
            for url, headers in ((decode.url, cluster.server_auth()), (cluster.gateways[0].url, AUTH)):
                answer = client.post(url + "/v1/completions", json={**COMPLETION, "seed": -1}, headers=headers)
                check_answer(answer, "seed -1")
                assert answer.status_code == 400 and answer.json()["error"]["param"] == "seed", answer.text
    assert_idle(cluster)
    assert client_answer(decode.url, cluster.server_auth()).status_code == 200
    assert normal_completion(cluster.gateways[0].url).status_code == 200


def client_answer(url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=COMPLETION, headers=headers, timeout=60)


def test_server_paths_and_methods(cluster: Cluster) -> None:
    with httpx.Client(timeout=60) as client:

        @FUZZ
        @given(
            role=st.sampled_from(["p", "d"]),
            path=st.one_of(PATHS, st.sampled_from(["/v1/models", "/health", "/health/ready", "/metrics"])),
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]),
            authorized=st.booleans(),
        )
        def attack(role: str, path: str, method: str, authorized: bool) -> None:
            headers = cluster.server_auth() if authorized else {}
            url = cluster.servers[role].url + path
            check_answer(
                send(client, method, url, b"{}" if method in ("POST", "PUT") else None, headers),
                f"{role} {method} {path}",
            )

        attack()
    assert_idle(cluster)


SCHEDULER_CALLS = [
    ("POST", "/v1/instances"),
    ("POST", "/v1/instances/{id}/heartbeat"),
    ("POST", "/v1/instances/{id}/drain"),
    ("DELETE", "/v1/instances/{id}"),
    ("GET", "/v1/routing"),
    ("GET", "/v1/instances"),
    ("GET", "/v1/advice"),
    ("GET", "/v1/admin/weights"),
    ("PUT", "/v1/admin/weights"),
]
INSTANCE_BASE = {
    "instance_id": "decode-fuzz",
    "role": "decode",
    "version": "v1",
    "kv_fingerprint": "fp",
    "url": "http://127.0.0.1:9",
}


@st.composite
def scheduler_bodies(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 4)) == 0:
        return draw(completion_bodies({}))  # raw junk, or an unrelated document
    document: dict[str, Any] = dict(
        draw(st.sampled_from([INSTANCE_BASE, {"load": {"ready": True}}, {"weights": {"v1": 1}}]))
    )
    document.update(
        draw(
            st.dictionaries(
                st.sampled_from([*INSTANCE_BASE, "load", "weights", "supported_params", "max_model_len", "kv_port"]),
                VALUES,
                max_size=3,
            )
        )
    )
    return encode(document)


def test_scheduler_endpoints(scratch_scheduler: tuple[Service, str]) -> None:
    """Every scheduler endpoint with the admin token (past authorization, into the body parsing) or a junk one."""
    service, admin = scratch_scheduler
    with httpx.Client(timeout=30) as client:

        @FUZZ
        @given(
            call=st.sampled_from(SCHEDULER_CALLS),
            body=scheduler_bodies(),
            instance=st.one_of(st.just("decode-fuzz"), HEADER_VALUES.filter(bool)),
            token=st.one_of(st.just(admin), HEADER_VALUES),
        )
        def attack(call: tuple[str, str], body: bytes, instance: str, token: str) -> None:
            method, path = call
            url = service.url + path.replace("{id}", quote(instance, safe=""))
            headers = {"Authorization": f"Bearer {token}".strip()}
            answer = send(client, method, url, body if method != "GET" else None, headers)
            check_answer(answer, f"scheduler {method} {path} {body[:200]!r}")

        attack()
    assert httpx.get(f"{service.url}/health/live").status_code == 200


def test_a_normal_request_after_the_fuzzing(cluster: Cluster) -> None:
    answer = normal_completion(cluster.gateways[0].url)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == NORMAL["max_tokens"]
