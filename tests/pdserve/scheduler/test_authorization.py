"""The scheduler's authorization matrix on a real process: every endpoint against every kind of caller.

Callers: no token, a wrong token, a token derived from another key, another instance's token, the gateway's token,
the instance's own token, the admin token. A refusal is 401 (no valid token) or 403 (a valid token of another
principal), changes nothing, and is counted by endpoint and reason.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.scheduler.client import bearer
from pdserve.scheduler.identity import derive_token
from tests.support.services import Service, identity_key_file, principal_token, start_scheduler

VICTIM = "decode-victim"
READS = ("routing", "list_instances", "advice", "get_weights")
WRITES = ("register", "heartbeat", "drain", "deregister")
OWN_READS = ("get_instance",)  # the instance itself, the gateway and the admin
ENDPOINTS = (*WRITES, *READS, *OWN_READS, "put_weights")


def victim_info(url: str = "http://127.0.0.1:9") -> dict[str, Any]:
    return {"instance_id": VICTIM, "role": "decode", "version": "v1", "kv_fingerprint": "fp", "url": url}


def call(base: str, endpoint: str, headers: dict[str, str]) -> httpx.Response:
    """One request to `endpoint` about the victim instance; a register names an attacker's URL."""
    requests: dict[str, tuple[str, str, Any]] = {
        "register": ("POST", "/v1/instances", victim_info("http://10.66.0.1:8100")),
        "heartbeat": ("POST", f"/v1/instances/{VICTIM}/heartbeat", {"load": {"ready": True}}),
        "drain": ("POST", f"/v1/instances/{VICTIM}/drain", None),
        "deregister": ("DELETE", f"/v1/instances/{VICTIM}", None),
        "routing": ("GET", "/v1/routing", None),
        "list_instances": ("GET", "/v1/instances", None),
        "get_instance": ("GET", f"/v1/instances/{VICTIM}", None),
        "advice": ("GET", "/v1/advice", None),
        "get_weights": ("GET", "/v1/admin/weights", None),
        "put_weights": ("PUT", "/v1/admin/weights", {"weights": {"v9": 1}}),
    }
    method, path, body = requests[endpoint]
    return httpx.request(method, base + path, json=body, headers=headers, timeout=10)


def refusals(base: str) -> dict[tuple[str, str], float]:
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for sample in family.samples:
            if sample.name == "pdserve_scheduler_requests_unauthorized_total":
                found[sample.labels["endpoint"], sample.labels["reason"]] = sample.value
    return found


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[Service, str, Path]]:
    service, admin = start_scheduler(tmp_path, heartbeat_interval=10.0)
    yield service, admin, tmp_path
    service.stop()


def test_every_endpoint_refuses_every_caller_it_does_not_serve(scheduler: tuple[Service, str, Path]) -> None:
    service, admin, tmp = scheduler
    base = service.url
    own = bearer(principal_token(tmp, f"instance:{VICTIM}"))
    gateway = bearer(principal_token(tmp, "gateway"))
    assert httpx.post(base + "/v1/instances", json=victim_info(), headers=own).status_code == 201
    unauthenticated = {
        "missing_token": {},
        "invalid_token": bearer("not-a-token"),
        "foreign_key": bearer(derive_token("some other key", f"instance:{VICTIM}")),
        "admin_as_instance": bearer(derive_token(admin, f"instance:{VICTIM}")),
    }
    other_instance = bearer(principal_token(tmp, "instance:decode-attacker"))
    expected_refusals: dict[tuple[str, str], int] = {}
    for name, headers in unauthenticated.items():
        for endpoint in ENDPOINTS:
            response = call(base, endpoint, headers)
            assert response.status_code == 401, (name, endpoint, response.text)
            assert response.json()["error"]["field"] == "authorization"
            reason = "missing_token" if name == "missing_token" else "invalid_token"
            expected_refusals[endpoint, reason] = expected_refusals.get((endpoint, reason), 0) + 1
    forbidden = {
        "other_instance": (other_instance, ENDPOINTS),
        "gateway": (gateway, (*WRITES, "put_weights")),
        "own_instance": (own, (*READS, "put_weights")),
    }
    for name, (headers, endpoints) in forbidden.items():
        for endpoint in endpoints:
            response = call(base, endpoint, headers)
            assert response.status_code == 403, (name, endpoint, response.text)
            expected_refusals[endpoint, "forbidden"] = expected_refusals.get((endpoint, "forbidden"), 0) + 1
    assert refusals(base) == expected_refusals

    listed = httpx.get(base + "/v1/instances", headers=gateway).json()["instances"]
    assert [(i["instance_id"], i["state"], i["info"]["url"]) for i in listed] == [
        (VICTIM, "starting", "http://127.0.0.1:9")
    ], "a refused request must change nothing"
    assert httpx.get(base + "/v1/admin/weights", headers=gateway).json()["weights"] == {}

    for endpoint in READS:
        assert call(base, endpoint, gateway).status_code == 200, endpoint
        assert call(base, endpoint, bearer(admin)).status_code == 200, endpoint
    for headers in (own, gateway, bearer(admin)):
        entry = call(base, "get_instance", headers)
        assert entry.status_code == 200 and entry.json()["instance_id"] == VICTIM, entry.text
    for headers in (own, bearer(admin)):
        assert [call(base, endpoint, headers).status_code for endpoint in WRITES] == [201, 200, 200, 204]
    gone = call(base, "get_instance", own)
    assert (gone.status_code, gone.json()["error"]["field"]) == (404, "instance_id")
    assert call(base, "put_weights", bearer(admin)).status_code == 200


def test_a_node_cannot_hijack_another_instance_id(scheduler: tuple[Service, str, Path]) -> None:
    """The attack of issue 13 finding 6: re-registering the victim's id with the attacker's URL."""
    service, _, tmp = scheduler
    base = service.url
    victim = bearer(principal_token(tmp, f"instance:{VICTIM}"))
    attacker = bearer(principal_token(tmp, "instance:decode-attacker"))
    assert httpx.post(base + "/v1/instances", json=victim_info(), headers=victim).status_code == 201
    hijack = httpx.post(base + "/v1/instances", json=victim_info("http://10.66.0.1:8100"), headers=attacker)
    assert hijack.status_code == 403 and hijack.json()["error"]["field"] == "instance_id"
    assert httpx.post(f"{base}/v1/instances/{VICTIM}/drain", headers=attacker).status_code == 403
    beat = httpx.post(f"{base}/v1/instances/{VICTIM}/heartbeat", json={"load": {"ready": True}}, headers=victim)
    assert beat.json()["state"] == "ready"
    table = httpx.get(base + "/v1/routing", headers=bearer(principal_token(tmp, "gateway"))).json()
    assert [i["info"]["url"] for i in table["instances"]] == ["http://127.0.0.1:9"]


def test_registration_needs_an_instance_id(scheduler: tuple[Service, str, Path]) -> None:
    service, admin, _ = scheduler
    body = {k: v for k, v in victim_info().items() if k != "instance_id"}
    response = httpx.post(service.url + "/v1/instances", json=body, headers=bearer(admin))
    assert response.status_code == 400 and response.json()["error"]["field"] == "instance_id"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"[" * 100_000, "body"),
        (b'{"load": {"queue_depth": NaN}}', "load.queue_depth"),
        (b'{"load": "\xff"}', "body"),
        (b'{"load": {"ready": Infinity}}', "load.ready"),
    ],
)
def test_malformed_bodies_are_400_not_500(scheduler: tuple[Service, str, Path], body: bytes, field: str) -> None:
    service, _, tmp = scheduler
    own = bearer(principal_token(tmp, f"instance:{VICTIM}"))
    response = httpx.post(f"{service.url}/v1/instances/{VICTIM}/heartbeat", content=body, headers=own)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["field"] == field


def test_unknown_paths_and_methods_name_what_is_wrong(scheduler: tuple[Service, str, Path]) -> None:
    service, _, _ = scheduler
    missing = httpx.get(service.url + "/v1/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "path"
    wrong = httpx.patch(service.url + "/v1/routing")
    assert wrong.status_code == 405 and wrong.json()["error"]["field"] == "method"


def minted(tmp: Path, principal: str) -> dict[str, str]:
    """A token in the derived format for `principal`, MACed under the scheduler's own identity key: what anyone
    holding the key (a deploy controller) could write, whether or not derive_token agrees to."""
    key = identity_key_file(tmp).read_text().strip()
    mac = hmac.new(key.encode(), b"pdstack-scheduler-principal\0" + principal.encode(), hashlib.sha256).hexdigest()
    return bearer(f"pds1.{principal}.{mac}")


@pytest.mark.parametrize("principal", ["admin", "ADMIN", "root", "scheduler", "instance:"])
def test_a_derived_token_is_never_the_admin(scheduler: tuple[Service, str, Path], principal: str) -> None:
    """Issue 33 finding 4: `pds1.admin.<mac>` was an admin (weights, verdicts, any instance id)."""
    service, admin, tmp = scheduler
    base, forged = service.url, minted(tmp, principal)
    verdict = {"canary": "v2", "baseline": "v1", "step_percent": 10, "outcome": "pass"}
    attempts = [
        ("PUT", "/v1/admin/weights", {"weights": {"v9": 1}}),
        ("POST", "/v1/admin/canary/verdicts", verdict),
        ("POST", "/v1/instances", victim_info("http://10.66.0.1:8100")),
        ("DELETE", f"/v1/instances/{VICTIM}", None),
        ("GET", "/v1/routing", None),
    ]
    for method, path, body in attempts:
        response = httpx.request(method, base + path, json=body, headers=forged, timeout=10)
        assert response.status_code == 401, (method, path, response.text)
        assert response.json()["error"]["field"] == "authorization"
    assert httpx.get(base + "/v1/admin/weights", headers=bearer(admin)).json()["weights"] == {}
    assert httpx.get(base + "/v1/instances", headers=bearer(admin)).json()["instances"] == []


@pytest.mark.parametrize(
    "weights",
    [{"v1": 1e308, "v2": 1e308}, {"v1": 1.7e308, "v2": 1e308, "v3": 1}],
)
def test_weights_whose_sum_overflows_are_refused(
    scheduler: tuple[Service, str, Path], weights: dict[str, float]
) -> None:
    """Finding 6: such weights were stored, and every gateway request then failed in random.choices."""
    service, admin, _ = scheduler
    response = httpx.put(service.url + "/v1/admin/weights", json={"weights": weights}, headers=bearer(admin))
    assert response.status_code == 400 and response.json()["error"]["field"] == "weights", response.text
    assert httpx.get(service.url + "/v1/admin/weights", headers=bearer(admin)).json()["weights"] == {}
    fine = httpx.put(
        service.url + "/v1/admin/weights", json={"weights": {"v1": 1e307, "v2": 1e307}}, headers=bearer(admin)
    )
    assert fine.status_code == 200, fine.text


def test_bodies_over_the_limit_get_413_before_they_are_read(scheduler: tuple[Service, str, Path]) -> None:
    """Finding 8: a 64 MiB heartbeat was read whole (71 -> 256 MiB RSS) before its 400. Declared or streamed, a
    body past max_body_bytes (256 KiB by default) is refused naming `body`, and the scheduler serves on."""
    service, _, tmp = scheduler
    own = bearer(principal_token(tmp, f"instance:{VICTIM}"))
    url = f"{service.url}/v1/instances/{VICTIM}/heartbeat"
    declared = httpx.post(url, content=b"x" * (8 << 20), headers=own, timeout=30)
    assert declared.status_code == 413 and declared.json()["error"]["field"] == "body", declared.text

    def chunks() -> Iterator[bytes]:
        for _ in range(64):  # 4 MiB in all, no Content-Length: refused once past the limit
            yield b" " * 65536

    streamed = httpx.post(url, content=chunks(), headers=own, timeout=30)
    assert streamed.status_code == 413 and streamed.json()["error"]["field"] == "body", streamed.text
    assert httpx.post(service.url + "/v1/instances", json=victim_info(), headers=own).status_code == 201
