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
from tests.support.services import Service, principal_token, start_scheduler


@dataclass(frozen=True)
class Scheduler:
    """A running scheduler as the tests use it: its URL, its admin token, and where its identity key is."""

    service: Service
    admin_token: str
    tmp: Path

    @property
    def url(self) -> str:
        return self.service.url

    def auth(self, instance_id: str) -> dict[str, str]:
        """The header the instance `instance_id` presents."""
        return bearer(principal_token(self.tmp, f"instance:{instance_id}"))

    @property
    def gateway_auth(self) -> dict[str, str]:
        return bearer(principal_token(self.tmp, "gateway"))

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        """A read as a gateway does it."""
        headers = {**self.gateway_auth, **kwargs.pop("headers", {})}
        return httpx.get(self.url + path, headers=headers, **kwargs)


def start(tmp_path: Path, **settings: Any) -> Scheduler:
    service, admin_token = start_scheduler(tmp_path, **settings)
    return Scheduler(service, admin_token, tmp_path)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[Scheduler]:
    """A scheduler that declares instances dead only after 30 s of silence, so a loaded machine cannot flake."""
    started = start(tmp_path, heartbeat_interval=10.0)
    yield started
    started.service.stop()


def register(scheduler: Scheduler, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{scheduler.url}/v1/instances", json=body, headers=scheduler.auth(body["instance_id"]))


def instance(instance_id: str, role: str = "decode", version: str = "v1", fingerprint: str = "fp-a") -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "role": role,
        "version": version,
        "kv_fingerprint": fingerprint,
        "url": "http://127.0.0.1:9",
        "model": "tiny",
    }


def beat(scheduler: Scheduler, instance_id: str, **load: Any) -> httpx.Response:
    return httpx.post(
        f"{scheduler.url}/v1/instances/{instance_id}/heartbeat",
        json={"load": {"ready": True, **load}},
        headers=scheduler.auth(instance_id),
    )


def states(scheduler: Scheduler) -> dict[str, str]:
    return {i["instance_id"]: i["state"] for i in scheduler.get("/v1/instances").json()["instances"]}


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
    assert states(scheduler) == {"d1": "starting"}
    assert (
        httpx.post(
            f"{url}/v1/instances/d1/heartbeat", json={"load": {"ready": False}}, headers=scheduler.auth("d1")
        ).json()["state"]
        == "starting"
    )
    assert beat(scheduler, "d1").json()["state"] == "ready"
    assert httpx.post(f"{url}/v1/instances/d1/drain", headers=scheduler.auth("d1")).json()["state"] == "draining"
    assert beat(scheduler, "d1").json()["state"] == "draining", "a heartbeat must not undo draining"
    wait_for(lambda: states(scheduler) == {"d1": "dead"}, timeout=30)  # heartbeats stopped


def test_routing_table_lists_only_ready_instances_and_supports_etag(scheduler: Scheduler) -> None:
    for name in ("p1", "d1", "d2"):
        register(scheduler, instance(name, role="prefill" if name.startswith("p") else "decode"))
    beat(scheduler, "p1")
    beat(scheduler, "d1", active_requests=3, max_concurrency=8)
    table = scheduler.get("/v1/routing")
    ids = {i["instance_id"]: i for i in table.json()["instances"]}
    assert set(ids) == {"p1", "d1"}
    assert ids["d1"]["load"]["active_requests"] == 3
    etag = table.headers["etag"]
    assert scheduler.get("/v1/routing", headers={"If-None-Match": etag}).status_code == 304
    beat(scheduler, "d2")
    changed = scheduler.get("/v1/routing", headers={"If-None-Match": etag})
    assert changed.status_code == 200
    assert {i["instance_id"] for i in changed.json()["instances"]} == {"p1", "d1", "d2"}


def test_kv_streaming_is_registered_and_routed(scheduler: Scheduler) -> None:
    """Gateways dispatch prefill and decode at once only to pairs that declared kv_streaming: the routing table
    carries it as registered, false for an instance that did not say (pdserve's servers, older connectors)."""
    register(scheduler, {**instance("p-stream", role="prefill"), "kv_streaming": True})
    register(scheduler, instance("d-plain"))
    bad = register(scheduler, {**instance("d-bad"), "kv_streaming": "sometimes"})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "kv_streaming"
    beat(scheduler, "p-stream")
    beat(scheduler, "d-plain")
    routed = {i["instance_id"]: i["info"] for i in scheduler.get("/v1/routing").json()["instances"]}
    assert routed["p-stream"]["kv_streaming"] is True
    assert routed["d-plain"]["kv_streaming"] is False


def test_deregister_and_unknown_heartbeat(scheduler: Scheduler) -> None:
    url = scheduler.url
    register(scheduler, instance("d1"))
    assert httpx.delete(f"{url}/v1/instances/d1", headers=scheduler.auth("d1")).status_code == 204
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
    response = httpx.post(
        f"{url}/v1/instances/d1/heartbeat", json={"load": {"queue_depth": -1}}, headers=scheduler.auth("d1")
    )
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
    assert scheduler.get("/v1/routing").json()["weights"] == {"v1": 90, "v2": 10}
    negative = httpx.put(
        f"{url}/v1/admin/weights", json={"weights": {"v2": -1}}, headers={"Authorization": f"Bearer {token}"}
    )
    assert negative.status_code == 400
    assert "weights.v2" in negative.json()["error"]["message"]


def test_canary_verdicts_are_recorded_by_the_admin_only_and_counted(scheduler: Scheduler) -> None:
    url, admin = scheduler.url, {"Authorization": f"Bearer {scheduler.admin_token}"}
    verdict = {"canary": "v2", "baseline": "v1", "step_percent": 20, "outcome": "pass"}
    assert httpx.post(f"{url}/v1/admin/canary/verdicts", json=verdict).status_code == 401
    # an instance's own token does not make it an operator
    assert httpx.post(f"{url}/v1/admin/canary/verdicts", json=verdict, headers=scheduler.auth("d1")).status_code == 403
    for step, outcome in ((20, "pass"), (50, "inconclusive"), (50, "fail")):
        body = verdict | {"step_percent": step, "outcome": outcome}
        assert httpx.post(f"{url}/v1/admin/canary/verdicts", json=body, headers=admin).status_code == 200
    bad = httpx.post(f"{url}/v1/admin/canary/verdicts", json=verdict | {"outcome": "maybe"}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "outcome"
    scrape = scheduler.get("/metrics").text
    for outcome in ("pass", "inconclusive", "fail"):
        line = f'pdserve_scheduler_canary_verdicts_total{{baseline="v1",canary="v2",outcome="{outcome}"}} 1.0'
        assert line in scrape, scrape
    assert 'pdserve_scheduler_canary_step_percent{canary="v2"} 50.0' in scrape


def beat_with(url: str, instance_id: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/v1/instances/{instance_id}/heartbeat", json={"load": {"ready": True}}, headers=headers)


def scheduler_command(folder: Path, admin_token_file: Path) -> list[str]:
    """`python -m pdserve.scheduler` with its state in `folder`, without an identity key."""
    return [
        sys.executable,
        "-m",
        "pdserve.scheduler",
        "--state-file",
        str(folder / "s.json"),
        "--admin-token-file",
        str(admin_token_file),
    ]


def test_scheduler_refuses_to_start_without_a_usable_identity_key(tmp_path: Path) -> None:
    (tmp_path / "admin.token").write_text("same-token\n")
    (tmp_path / "same.key").write_text("same-token\n")
    (tmp_path / "empty.key").write_text("\n")
    base = scheduler_command(tmp_path, tmp_path / "admin.token")
    causes = (("missing.key", "missing.key"), ("empty.key", "is empty"), ("same.key", "holds the admin token"))
    for key, cause in causes:
        result = subprocess.run(
            [*base, "--identity-key-file", str(tmp_path / key)], check=False, capture_output=True, text=True, timeout=30
        )
        assert result.returncode != 0
        assert "identity_key_file" in result.stderr and cause in result.stderr, result.stderr
    old = subprocess.run(
        [*base, "--instance-token-file", str(tmp_path / "same.key")],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert old.returncode == 2 and "--instance-token-file" in old.stderr, "the shared instance token is gone"


def test_weights_survive_a_restart(tmp_path: Path) -> None:
    service, token = start_scheduler(tmp_path)
    try:
        httpx.put(
            f"{service.url}/v1/admin/weights",
            json={"weights": {"v1": 75, "v2": 25}},
            headers={"Authorization": f"Bearer {token}"},
        ).raise_for_status()
    finally:
        service.kill()  # no graceful shutdown: the state must already be on disk
    restarted, _ = start_scheduler(tmp_path, port=service.port)
    try:
        reader = Scheduler(restarted, token, tmp_path)
        assert reader.get("/v1/admin/weights").json()["weights"] == {"v1": 75, "v2": 25}
        assert reader.get("/v1/routing").json()["weights"] == {"v1": 75, "v2": 25}
    finally:
        restarted.stop()


def test_advice_recommends_ratio_and_direction(scheduler: Scheduler) -> None:
    for name in ("p1", "p2"):
        register(scheduler, instance(name, role="prefill"))
        beat(scheduler, name, active_requests=4, max_concurrency=4)  # saturated
    for name in ("d1", "d2", "d3"):
        register(scheduler, instance(name))
        beat(scheduler, name, active_requests=1, max_concurrency=10, kv_used_bytes=5, kv_capacity_bytes=100)
    advice = scheduler.get("/v1/advice").json()
    assert advice["prefill"]["utilisation"] == 1.0
    assert advice["prefill"]["scale"] == "up"
    assert advice["decode"]["utilisation"] == pytest.approx(0.1)
    assert advice["decode"]["scale"] == "down"
    # 2 busy prefill at target 0.6 -> 4 instances; 0.3 busy decode -> 1 instance.
    assert advice["prefill"]["recommended_instances"] == 4
    assert advice["decode"]["recommended_instances"] == 1
    assert advice["recommended_pd_ratio"] == 4.0


def test_bad_flag_value_exits_naming_the_flag(tmp_path: Path) -> None:
    flags = ["--identity-key-file", str(tmp_path / "i"), "--heartbeat-interval", "soon"]
    command = [*scheduler_command(tmp_path, tmp_path / "t"), *flags]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--heartbeat-interval" in result.stderr


def test_metrics_pass_promtool(scheduler: Scheduler) -> None:
    url = scheduler.url
    register(scheduler, instance("d1"))
    beat(scheduler, "d1")
    scheduler.get("/v1/routing")
    httpx.get(f"{url}/v1/routing")  # refused: a labelled refusal counter must pass promtool too
    text = httpx.get(f"{url}/metrics").text
    assert 'pdserve_scheduler_instances{role="decode",state="ready",version="v1"} 1.0' in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: apt-get install prometheus"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, check=False, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr
