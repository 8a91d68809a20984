"""The serving playbook and the pdserve, model_artifacts roles on real node containers, in the order an operator
meets them: install r1, converge again, upgrade to r2 (drained), roll back, a corrupt model, a killed decode."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.deploy.conftest import MODEL_NAME, NODE_A, NODE_B, Serving

# Each ansible-playbook run converges two nodes over `podman exec`; on a loaded 2-core host one run can take minutes.
pytestmark = pytest.mark.timeout(1800)


def instances(serving: Serving) -> list[dict[str, object]]:
    found: list[dict[str, object]] = httpx.get(f"{serving.scheduler()}/v1/instances", timeout=5).json()["instances"]
    return found


def versions_ready(serving: Serving) -> set[tuple[str, str]]:
    return {(str(i["info"]["role"]), str(i["info"]["version"]))  # type: ignore[index]
            for i in instances(serving) if i["state"] == "ready"}


def serve(serving: Serving, *wanted: tuple[str, str], timeout: float = 30.0) -> bool:
    """Whether (role, version) pairs are all ready, given a few seconds: a stalled heartbeat on a loaded host can
    take an instance out of the table for a moment."""
    deadline = time.monotonic() + timeout
    while not set(wanted) <= versions_ready(serving):
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


@pytest.fixture(scope="module")
def installed(serving: Serving) -> Serving:
    first = serving.play("serving.yml", "--skip-tags", "prometheus", "-e", f"@{serving.release_vars('r1')}")
    assert first.returncode == 0, first.output[-5000:]
    return serving


def test_install_serves_requests_through_gateway_prefill_and_decode(installed: Serving) -> None:
    response = installed.complete()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    assert serve(installed, ("prefill", "r1"), ("decode", "r1")), versions_ready(installed)
    routed = httpx.get(f"{installed.gateway()}/metrics", timeout=10).text
    assert 'reason="remote_prefill"' in routed  # the KV crossed from node A's prefill to node B's decode


def test_images_are_pulled_by_digest_and_the_release_is_recorded(installed: Serving) -> None:
    for node, component in ((NODE_A, "scheduler"), (NODE_A, "prefill"), (NODE_A, "gateway"), (NODE_B, "decode")):
        inspect = json.loads(installed.node(node, "podman", "inspect", f"pdserve-{component}"))[0]
        assert inspect["ImageName"] == installed.image and "@sha256:" in installed.image
        assert inspect["HostConfig"]["RestartPolicy"]["Name"] == "always"
        assert inspect["Config"]["Healthcheck"]["Test"]
        record = installed.record(node, component)
        assert record["current"] == {"image": installed.image, "version": "r1", "config_version": "1"}
        assert record["previous"] is None


def test_secrets_are_podman_secrets_never_environment_or_logs(installed: Serving) -> None:
    kv_key = installed.secrets.kv_channel_key.read_text().strip()
    inspect = installed.node(NODE_B, "podman", "inspect", "pdserve-decode")
    assert kv_key not in inspect
    assert installed.secrets.scheduler_instance_token.read_text().strip() not in inspect
    assert "PDSERVE_KV_KEY_FILE=/run/secrets/kv.key" in inspect
    names = installed.node(NODE_B, "podman", "secret", "ls", "--format", "{{.Name}}").split()
    assert sorted(name.rsplit("-", 1)[0] for name in names) == ["pdstack-instance-token", "pdstack-kv-key"], names
    mode = installed.node(NODE_B, "podman", "exec", "pdserve-decode", "stat", "-c", "%a %u", "/run/secrets/kv.key")
    assert mode.split() == ["400", "10001"]
    again = installed.play("serving.yml", "--skip-tags", "prometheus", "-e", f"@{installed.release_vars('r1')}", "-v")
    assert kv_key not in again.output
    assert installed.secrets.scheduler_admin_token.read_text().strip() not in again.output
    assert installed.secrets.scheduler_instance_token.read_text().strip() not in again.output
    assert again.returncode == 0 and again.changed() == 0, again.output[-5000:]


def test_upgrade_drains_each_server_before_replacing_it(installed: Serving) -> None:
    metrics = "pdserve_scheduler_instance_transitions_total{state=\"draining\"}"

    def drained() -> float:
        text = httpx.get(f"{installed.scheduler()}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metrics))

    before = drained()
    upgrade = installed.play("serving.yml", "--skip-tags", "prometheus", "-e", f"@{installed.release_vars('r2', '2')}")
    assert upgrade.returncode == 0, upgrade.output[-5000:]
    assert drained() - before == 2  # the prefill and the decode server, each drained before its stop
    assert serve(installed, ("prefill", "r2"), ("decode", "r2")), versions_ready(installed)
    assert installed.complete().status_code == 200
    record = installed.record(NODE_B, "decode")
    assert record["current"]["version"] == "r2" and record["previous"]["version"] == "r1"


def test_rollback_restores_the_previous_release(installed: Serving) -> None:
    rollback = installed.play("rollback.yml", "-e", f"@{installed.release_vars('r2', '2')}")
    assert rollback.returncode == 0, rollback.output[-5000:]
    assert installed.record(NODE_B, "decode")["current"] == {"image": installed.image, "version": "r1",
                                                             "config_version": "1"}
    assert serve(installed, ("prefill", "r1"), ("decode", "r1")), versions_ready(installed)
    weights = httpx.get(f"{installed.scheduler()}/v1/admin/weights", timeout=5).json()["weights"]
    assert weights == {"r1": 100}
    assert installed.complete().status_code == 200


def test_a_corrupt_model_stops_the_rollout_before_any_server_restarts(installed: Serving) -> None:
    weights = installed.model_source / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        bad = installed.play("serving.yml", "--skip-tags", "prometheus",
                             "-e", f"@{installed.release_vars('r3', '3')}")
    finally:
        weights.write_bytes(original)
    assert bad.returncode != 0
    message = " ".join(bad.output.split())
    assert "model.safetensors: sha256" in message and "manifest says" in message
    assert "No server starts on these weights" in message
    assert installed.record(NODE_A, "prefill")["current"]["version"] == "r1"
    assert installed.record(NODE_B, "decode")["current"]["version"] == "r1"


def test_a_killed_decode_container_is_restarted_and_requests_recover(installed: Serving) -> None:
    pid = installed.node(NODE_B, "podman", "inspect", "--format", "{{.State.Pid}}", "pdserve-decode").strip()
    installed.node(NODE_B, "kill", "-KILL", pid)
    # The scheduler lists the dead process as ready until its heartbeats lapse, so "registered" proves nothing here:
    # wait for podman to restart the container and its health check (GET /health/ready) to pass.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = installed.node(NODE_B, "podman", "inspect", "--format", "{{.State.Pid}} {{.State.Health.Status}}",
                               "pdserve-decode").split()
        if state[0] not in ("0", pid) and state[1:] == ["healthy"]:
            break
        time.sleep(2)
    else:
        raise AssertionError("the decode container was not restarted and healthy within 180 s")
    # This cluster has one decode server, so there is no other to retry on while the gateway's routing table catches
    # up (it suspends a failed instance for 5 s): requests must succeed again within seconds, not at once.
    deadline = time.monotonic() + 30
    while (response := installed.complete(prompt=f"{MODEL_NAME} after a restart")).status_code != 200:
        assert time.monotonic() < deadline, response.text
        time.sleep(1)
    assert serve(installed, ("decode", "r1")), versions_ready(installed)
