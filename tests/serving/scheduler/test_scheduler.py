"""The scheduler as a real process: registration, heartbeats and states, routing table, weights, advice, metrics."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.scheduler.client import bearer

from .services import Service, instance_token_file, start_scheduler


@dataclass(frozen=True)
class Scheduler:
    """A running scheduler as the tests use it: its URL, its admin token, and the instance token's header."""

    service: Service
    admin_token: str
    instance_auth: dict[str, str]

    @property
    def url(self) -> str:
        return self.service.url


def start(tmp_path: Path, **settings: Any) -> Scheduler:
    service, admin_token = start_scheduler(tmp_path, **settings)
    return Scheduler(service, admin_token, bearer(instance_token_file(tmp_path).read_text().strip()))


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[Scheduler]:
    """A scheduler that declares instances dead only after 30 s of silence, so a loaded machine cannot flake."""
    started = start(tmp_path, heartbeat_interval=10.0)
    yield started
    started.service.stop()


def register(scheduler: Scheduler, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{scheduler.url}/v1/instances", json=body, headers=scheduler.instance_auth)


def instance(instance_id: str, role: str = "decode", version: str = "v1", fingerprint: str = "fp-a") -> dict[str, Any]:
    return {"instance_id": instance_id, "role": role, "version": version, "kv_fingerprint": fingerprint,
            "url": "http://127.0.0.1:9", "model": "tiny"}


def beat(scheduler: Scheduler, instance_id: str, **load: Any) -> httpx.Response:
    return httpx.post(f"{scheduler.url}/v1/instances/{instance_id}/heartbeat", json={"load": {"ready": True, **load}},
                      headers=scheduler.instance_auth)


def states(url: str) -> dict[str, str]:
    return {i["instance_id"]: i["state"] for i in httpx.get(f"{url}/v1/instances").json()["instances"]}


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_states_starting_ready_draining_dead(tmp_path: Path) -> None:
    scheduler = start(tmp_path, heartbeat_interval=0.5, missed=10)  # dead after 5 s of silence
    try:
        check_state_machine(scheduler)
    finally:
        scheduler.service.stop()


def check_state_machine(scheduler: Scheduler) -> None:
    url = scheduler.url
    assert register(scheduler, instance("d1")).status_code == 201
    assert states(url) == {"d1": "starting"}
    assert httpx.post(f"{url}/v1/instances/d1/heartbeat", json={"load": {"ready": False}},
                      headers=scheduler.instance_auth).json()["state"] == "starting"
    assert beat(scheduler, "d1").json()["state"] == "ready"
    assert httpx.post(f"{url}/v1/instances/d1/drain", headers=scheduler.instance_auth).json()["state"] == "draining"
    assert beat(scheduler, "d1").json()["state"] == "draining", "a heartbeat must not undo draining"
    wait_for(lambda: states(url) == {"d1": "dead"}, timeout=30)  # heartbeats stopped


def test_routing_table_lists_only_ready_instances_and_supports_etag(scheduler: Scheduler) -> None:
    url = scheduler.url
    for name in ("p1", "d1", "d2"):
        register(scheduler, instance(name, role="prefill" if name.startswith("p") else "decode"))
    beat(scheduler, "p1")
    beat(scheduler, "d1", active_requests=3, max_concurrency=8)
    table = httpx.get(f"{url}/v1/routing")
    ids = {i["instance_id"]: i for i in table.json()["instances"]}
    assert set(ids) == {"p1", "d1"}
    assert ids["d1"]["load"]["active_requests"] == 3
    etag = table.headers["etag"]
    assert httpx.get(f"{url}/v1/routing", headers={"If-None-Match": etag}).status_code == 304
    beat(scheduler, "d2")
    changed = httpx.get(f"{url}/v1/routing", headers={"If-None-Match": etag})
    assert changed.status_code == 200
    assert {i["instance_id"] for i in changed.json()["instances"]} == {"p1", "d1", "d2"}


def test_deregister_and_unknown_heartbeat(scheduler: Scheduler) -> None:
    url = scheduler.url
    register(scheduler, instance("d1"))
    assert httpx.delete(f"{url}/v1/instances/d1", headers=scheduler.instance_auth).status_code == 204
    response = beat(scheduler, "d1")
    assert response.status_code == 404
    assert "register again" in response.json()["error"]["message"]


def test_bad_registration_names_the_field(scheduler: Scheduler) -> None:
    url = scheduler.url
    bad = instance("d1") | {"role": "router"}
    response = register(scheduler, bad)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "role"
    response = register(scheduler, instance("d1") | {"url": "ftp://x"})
    assert response.json()["error"]["field"] == "url"
    response = httpx.post(f"{url}/v1/instances/d1/heartbeat", json={"load": {"queue_depth": -1}},
                          headers=scheduler.instance_auth)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "load.queue_depth"


def test_weights_need_the_admin_token(scheduler: Scheduler) -> None:
    url, token = scheduler.url, scheduler.admin_token
    body = {"weights": {"v1": 90, "v2": 10}}
    assert httpx.put(f"{url}/v1/admin/weights", json=body).status_code == 401
    wrong = httpx.put(f"{url}/v1/admin/weights", json=body, headers={"Authorization": "Bearer " + token + "x"})
    assert wrong.status_code == 401
    ok = httpx.put(f"{url}/v1/admin/weights", json=body, headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200
    assert httpx.get(f"{url}/v1/routing").json()["weights"] == {"v1": 90, "v2": 10}
    negative = httpx.put(f"{url}/v1/admin/weights", json={"weights": {"v2": -1}},
                         headers={"Authorization": f"Bearer {token}"})
    assert negative.status_code == 400
    assert "weights.v2" in negative.json()["error"]["message"]


def test_instance_api_needs_the_instance_token(scheduler: Scheduler) -> None:
    url, admin_token = scheduler.url, scheduler.admin_token
    stranger = {"Authorization": scheduler.instance_auth["Authorization"] + "x"}
    for headers in ({}, stranger):
        assert httpx.post(f"{url}/v1/instances", json=instance("rogue"), headers=headers).status_code == 401
        assert beat_with(url, "rogue", headers).status_code == 401
    assert states(url) == {}, "an unauthenticated registration must not enter the registry"
    assert register(scheduler, instance("d1")).status_code == 201
    for method, path in (("POST", "/v1/instances/d1/drain"), ("DELETE", "/v1/instances/d1")):
        assert httpx.request(method, url + path, headers=stranger).status_code == 401
    assert states(url) == {"d1": "starting"}, "a refused drain or deregistration must change nothing"
    # Operators may drain by hand with the admin token; the instance token cannot change the weights.
    assert httpx.post(f"{url}/v1/instances/d1/drain", headers=bearer(admin_token)).status_code == 200
    weights = httpx.put(f"{url}/v1/admin/weights", json={"weights": {"v1": 1}}, headers=scheduler.instance_auth)
    assert weights.status_code == 401
    text = httpx.get(f"{url}/metrics").text
    assert "pdserve_scheduler_instance_requests_unauthorized_total 6.0" in text


def beat_with(url: str, instance_id: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/v1/instances/{instance_id}/heartbeat", json={"load": {"ready": True}}, headers=headers)


def test_scheduler_refuses_to_start_without_its_tokens(tmp_path: Path) -> None:
    (tmp_path / "admin.token").write_text("same-token\n")
    (tmp_path / "instance.token").write_text("same-token\n")
    base = [sys.executable, "-m", "pdserve.scheduler", "--state-file", str(tmp_path / "s.json"),
            "--admin-token-file", str(tmp_path / "admin.token")]
    for extra, cause in ((["--instance-token-file", str(tmp_path / "missing.token")], "missing.token"),
                         (["--instance-token-file", str(tmp_path / "instance.token")], "holds the admin token")):
        result = subprocess.run([*base, *extra], check=False, capture_output=True, text=True, timeout=30)
        assert result.returncode != 0
        assert "instance_token_file" in result.stderr and cause in result.stderr, result.stderr


def test_weights_survive_a_restart(tmp_path: Path) -> None:
    service, token = start_scheduler(tmp_path)
    try:
        httpx.put(f"{service.url}/v1/admin/weights", json={"weights": {"v1": 75, "v2": 25}},
                  headers={"Authorization": f"Bearer {token}"}).raise_for_status()
    finally:
        service.kill()  # no graceful shutdown: the state must already be on disk
    restarted, _ = start_scheduler(tmp_path, port=service.port)
    try:
        assert httpx.get(f"{restarted.url}/v1/admin/weights").json()["weights"] == {"v1": 75, "v2": 25}
        assert httpx.get(f"{restarted.url}/v1/routing").json()["weights"] == {"v1": 75, "v2": 25}
    finally:
        restarted.stop()


def test_advice_recommends_ratio_and_direction(scheduler: Scheduler) -> None:
    url = scheduler.url
    for name in ("p1", "p2"):
        register(scheduler, instance(name, role="prefill"))
        beat(scheduler, name, active_requests=4, max_concurrency=4)  # saturated
    for name in ("d1", "d2", "d3"):
        register(scheduler, instance(name))
        beat(scheduler, name, active_requests=1, max_concurrency=10, kv_used_bytes=5, kv_capacity_bytes=100)
    advice = httpx.get(f"{url}/v1/advice").json()
    assert advice["prefill"]["utilisation"] == 1.0
    assert advice["prefill"]["scale"] == "up"
    assert advice["decode"]["utilisation"] == pytest.approx(0.1)
    assert advice["decode"]["scale"] == "down"
    # 2 busy prefill at target 0.6 -> 4 instances; 0.3 busy decode -> 1 instance.
    assert advice["prefill"]["recommended_instances"] == 4
    assert advice["decode"]["recommended_instances"] == 1
    assert advice["recommended_pd_ratio"] == 4.0


def test_bad_flag_value_exits_naming_the_flag(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve.scheduler", "--state-file", str(tmp_path / "s.json"),
                             "--admin-token-file", str(tmp_path / "t"), "--instance-token-file",
                             str(tmp_path / "i"), "--heartbeat-interval", "soon"],
                            check=False, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--heartbeat-interval" in result.stderr


def test_metrics_pass_promtool(scheduler: Scheduler) -> None:
    url = scheduler.url
    register(scheduler, instance("d1"))
    beat(scheduler, "d1")
    httpx.get(f"{url}/v1/routing")
    text = httpx.get(f"{url}/metrics").text
    assert 'pdserve_scheduler_instances{role="decode",state="ready",version="v1"} 1.0' in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: apt-get install prometheus"
    result = subprocess.run([promtool, "check", "metrics"], input=text, check=False, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr
