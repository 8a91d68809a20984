"""The serving playbook and the pdserve, model_artifacts roles on real node containers, in the order an operator
meets them: install r1, converge again, upgrade to r2 (drained), roll back, a corrupt model, a killed decode."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import testinfra

from pdserve.scheduler import identity
from pdstack.contract.components import Component
from pdstack.local.inventory import NESTED_NODE_VARS
from tests.deploy.conftest import CONTRACT, MODEL_NAME, NODE_A, NODE_B, Serving

# Each ansible-playbook run converges two nodes over `podman exec`; on a loaded 2-core host one run can take minutes.
pytestmark = pytest.mark.timeout(1800)


def admin(serving: Serving) -> dict[str, str]:
    return {"Authorization": f"Bearer {serving.secrets.scheduler_admin_token.read_text().strip()}"}


def instances(serving: Serving) -> list[dict[str, object]]:
    found: list[dict[str, object]] = serving.internal.get(
        f"{serving.scheduler()}/v1/instances", headers=admin(serving), timeout=5
    ).json()["instances"]
    return found


def instance_id(serving: Serving, node: str, component: str) -> str:
    return serving.node(
        node, "podman", "inspect", "--format", '{{index .Config.Labels "pdstack.instance_id"}}', f"pdserve-{component}"
    ).strip()


def versions_ready(serving: Serving) -> set[tuple[str, str]]:
    return {
        (str(i["info"]["role"]), str(i["info"]["version"]))  # type: ignore[index]
        for i in instances(serving)
        if i["state"] == "ready"
    }


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
    """One converge of the whole serving.yml (Alertmanager and Prometheus included) that every test here shares;
    the tests after the idempotence check converge only the parts they change."""
    first = serving.play("serving.yml", "-e", f"@{serving.release_vars('r1')}")
    assert first.returncode == 0, first.output[-5000:]
    return serving


def test_install_serves_requests_through_gateway_prefill_and_decode(installed: Serving) -> None:
    response = installed.complete()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    assert serve(installed, ("prefill", "r1"), ("decode", "r1")), versions_ready(installed)
    assert httpx.get(f"{installed.gateway()}/metrics", timeout=10).status_code == 401  # the metrics token only
    routed = installed.gateway_metrics()
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
    secrets = installed.secrets
    kv_key = secrets.kv_channel_key.read_text().strip()
    identity_key = secrets.scheduler_identity_key.read_text().strip()
    decode_id = instance_id(installed, NODE_B, "decode")
    own_token = identity.derive_token(identity_key, identity.instance_principal(decode_id))
    inspect = installed.node(NODE_B, "podman", "inspect", "pdserve-decode")
    for value in (kv_key, identity_key, own_token, secrets.server_api_token.read_text().strip()):
        assert value not in inspect
    assert "PDSERVE_KV_KEY_FILE=/run/secrets/kv.key" in inspect
    assert "PDSERVE_API_TOKEN_FILE=/run/secrets/server.token" in inspect
    # The decode node holds its own scheduler token, never the identity key that mints everyone's.
    names = installed.node(NODE_B, "podman", "secret", "ls", "--format", "{{.Name}}").split()
    decode_secrets = CONTRACT[Component.DECODE].secrets  # kv key, server token, its own scheduler token
    assert sorted(name.rsplit("-", 1)[0] for name in names) == sorted(f"pdstack-{s.key}" for s in decode_secrets), names
    mounted = installed.node(NODE_B, "podman", "exec", "pdserve-decode", "ls", "/run/secrets").split()
    assert sorted(mounted) == sorted(s.file for s in decode_secrets) == ["kv.key", "scheduler.token", "server.token"]
    held = installed.node(NODE_B, "podman", "exec", "pdserve-decode", "cat", "/run/secrets/scheduler.token")
    assert held.strip() == own_token
    mode = installed.node(NODE_B, "podman", "exec", "pdserve-decode", "stat", "-c", "%a %u", "/run/secrets/kv.key")
    assert mode.split() == ["400", "10001"]
    # The idempotence check, once for the whole serving.yml: Alertmanager, Prometheus and Redis included.
    again = installed.play("serving.yml", "-e", f"@{installed.release_vars('r1')}", "-v")
    for path in (*secrets.generated(), secrets.api_keys):
        assert path.read_text().strip() not in again.output, path.name
    assert own_token not in again.output
    assert identity.derive_token(identity_key, identity.GATEWAY) not in again.output
    assert again.returncode == 0 and again.changed() == 0, again.output[-5000:]


def test_one_nodes_token_cannot_touch_another_instance(installed: Serving) -> None:
    held = installed.node(NODE_B, "podman", "exec", "pdserve-decode", "cat", "/run/secrets/scheduler.token").strip()
    prefill_id = instance_id(installed, NODE_A, "prefill")
    bearer = {"Authorization": f"Bearer {held}"}
    drain = installed.internal.post(
        f"{installed.scheduler()}/v1/instances/{prefill_id}/drain", headers=bearer, timeout=5
    )
    assert drain.status_code == 403, drain.text
    routing = f"{installed.scheduler()}/v1/routing"
    assert installed.internal.get(routing, headers=bearer, timeout=5).status_code == 403
    assert installed.internal.get(routing, timeout=5).status_code == 401
    with pytest.raises(httpx.TransportError):  # mutual TLS: no client certificate, no HTTP at all
        httpx.get(routing, headers=admin(installed), timeout=5)
    assert serve(installed, ("prefill", "r1"), ("decode", "r1")), versions_ready(installed)


def test_servers_serve_only_callers_holding_the_server_token(installed: Serving) -> None:
    decode = f"https://{installed.address[NODE_B]}:{CONTRACT[Component.DECODE].port}"
    url = f"{decode}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": "straight to decode", "max_tokens": 4}
    assert installed.internal.post(url, json=body, timeout=30).status_code == 401
    token = installed.secrets.server_api_token.read_text().strip()
    allowed = installed.internal.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    assert allowed.status_code == 200, allowed.text
    assert installed.internal.get(f"{decode}{CONTRACT[Component.DECODE].health_ready}", timeout=5).status_code == 200
    with pytest.raises(httpx.TransportError):  # the token is not enough without a client certificate
        httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_redis_holds_the_gateways_rate_limits_behind_its_password(installed: Serving) -> None:
    node = testinfra.get_host(f"podman://{NODE_A}")
    address = installed.address[NODE_A]
    assert node.package("redis-server").is_installed
    service = node.service("redis-server")
    assert service.is_running and service.is_enabled
    # Bound to the node's address only (not 127.0.0.1, not every address).
    assert node.socket(f"tcp://{address}:6379").is_listening
    assert not node.socket("tcp://0.0.0.0:6379").is_listening
    assert not node.socket("tcp://127.0.0.1:6379").is_listening
    conf = node.file("/etc/redis/redis.conf")
    assert (conf.user, conf.group, conf.mode) == ("redis", "redis", 0o640)
    assert "protected-mode yes" in conf.content_string
    # TLS only (#17), requiring a client certificate from the stack's CA (the local stack's mutual TLS): the node's
    # own pair, copied beside the CA, is one.
    assert {"port 0", "tls-port 6379", "tls-auth-clients yes"} <= set(conf.content_string.splitlines())
    key = node.file("/etc/redis/tls/tls.key")
    assert (key.user, key.mode) == ("redis", 0o400)
    tls = "--tls --cacert /etc/redis/tls/ca.crt --cert /etc/redis/tls/tls.crt --key /etc/redis/tls/tls.key"
    anonymous = node.run(f"redis-cli {tls} -h {address} PING")
    assert "NOAUTH" in anonymous.stdout + anonymous.stderr
    password = installed.secrets.ratelimit_store_password.read_text().strip()
    authed = node.run(f"REDISCLI_AUTH={password} redis-cli {tls} -h {address} PING")
    assert authed.stdout.strip() == "PONG"
    plaintext = node.run(f"REDISCLI_AUTH={password} redis-cli -h {address} PING")
    assert "PONG" not in plaintext.stdout
    without_pair = node.run(
        f"REDISCLI_AUTH={password} redis-cli --tls --cacert /etc/redis/tls/ca.crt -h {address} PING"
    )
    assert "PONG" not in without_pair.stdout
    inspect = installed.node(NODE_A, "podman", "inspect", "pdserve-gateway")
    assert f"PDSERVE_RATE_LIMIT_STORAGE=rediss://{address}:6379/0" in inspect and password not in inspect
    # On the shared store: at once, or within one background probe (5 s) when the gateway came up before the store
    # answered over TLS (CI's first run of stop 25 saw the gauge at 0 with no request to retry it).
    deadline = time.monotonic() + 30
    while "pdserve_gateway_rate_limit_shared 1.0" not in (shared := gateway_gauge(installed)):
        assert time.monotonic() < deadline, shared
        time.sleep(1)


def gateway_gauge(installed: Serving) -> str:
    metrics = installed.gateway_metrics()
    return next((line for line in metrics.splitlines() if line.startswith("pdserve_gateway_rate_limit_shared ")), "")


def test_prometheus_reloads_on_sighup_with_its_lifecycle_api_off(installed: Serving) -> None:
    # Its API over HTTPS (#17), to a client with a certificate from the CA only (the local stack's mutual TLS).
    prometheus = f"https://{installed.address[NODE_A]}:9090"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{prometheus}/-/ready", verify=str(installed.tls.ca_cert), timeout=5)
    for path in ("/-/reload", "/-/quit"):
        refused = installed.internal.post(f"{prometheus}{path}", timeout=5)
        assert refused.status_code == 403 and "Lifecycle API is not enabled" in refused.text, path
    started = installed.node(NODE_A, "podman", "inspect", "--format", "{{.State.StartedAt}}", "prometheus")
    changed = installed.play(
        "serving.yml",
        "--tags",
        "prometheus",
        "-e",
        "prometheus_scrape_interval=7s",
        "-e",
        f"@{installed.release_vars('r1')}",
    )
    assert changed.returncode == 0, changed.output[-5000:]
    assert "Send Prometheus SIGHUP" in changed.output
    config = installed.internal.get(f"{prometheus}/api/v1/status/config", timeout=5).json()["data"]["yaml"]
    assert "scrape_interval: 7s" in config
    assert installed.node(NODE_A, "podman", "inspect", "--format", "{{.State.StartedAt}}", "prometheus") == started


def test_alertmanager_takes_prometheus_alerts_over_mutual_tls_only(installed: Serving) -> None:
    """Under the stack's mutual TLS it listens on the control node's address (#17): HTTPS, a client certificate from
    the CA required, and its Prometheus sends there; amtool on the node reaches it with the node's pair."""
    alertmanager = f"https://{installed.address[NODE_A]}:{CONTRACT.alertmanager.port}"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{alertmanager}/-/ready", verify=str(installed.tls.ca_cert), timeout=5)
    assert installed.internal.get(f"{alertmanager}/-/ready", timeout=5).status_code == 200
    prometheus = f"https://{installed.address[NODE_A]}:9090"
    expected, deadline = [f"{alertmanager}/api/v2/alerts"], time.monotonic() + 30  # found again after a reload
    while (active := active_alertmanagers(installed, prometheus)) != expected and time.monotonic() < deadline:
        time.sleep(1)
    assert active == expected
    assert "receivers:" in installed.node(NODE_A, "amtool", "config", "show")


def active_alertmanagers(installed: Serving, prometheus: str) -> list[str]:
    found = installed.internal.get(f"{prometheus}/api/v1/alertmanagers", timeout=5).json()["data"]
    return [a["url"] for a in found["activeAlertmanagers"]]


def test_upgrade_drains_each_server_before_replacing_it(installed: Serving) -> None:
    metrics = 'pdserve_scheduler_instance_transitions_total{state="draining"}'

    def drained() -> float:
        text = installed.internal.get(f"{installed.scheduler()}/metrics", timeout=5).text  # no token, like /health
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metrics))

    # As if the decode node had run vLLM before (containers and the run volume named as roles/vllm_engine names
    # them; the pdserve image idles in their place): the upgrade drains and removes them.
    vllm = ["vllm-decode", "vllm-decode-agent"]
    installed.node(NODE_B, "podman", "volume", "create", "vllm-decode-run")
    mounts = [f"--volume={v}" for v in NESTED_NODE_VARS["pdserve_extra_volumes"]]  # as the roles run them
    for name in vllm:
        # no network: podman's default bridge inside the node is the outer one's subnet and would cut the node off
        installed.node(
            NODE_B,
            "podman",
            "run",
            "-d",
            "--name",
            name,
            *mounts,
            "--network=none",
            "--stop-signal",
            "KILL",
            "--entrypoint",
            "sleep",
            installed.image,
            "600",
        )
    before = drained()
    upgrade = installed.play("serving.yml", "--skip-tags", "prometheus", "-e", f"@{installed.release_vars('r2', '2')}")
    assert upgrade.returncode == 0, upgrade.output[-5000:]
    assert drained() - before == 2  # the prefill and the decode server, each drained before its stop
    left = installed.node(NODE_B, "podman", "ps", "-a", "--format", "{{.Names}}").split()
    assert not set(vllm) & set(left) and "pdserve-decode" in left, left
    assert "vllm-decode-run" not in installed.node(NODE_B, "podman", "volume", "ls", "--format", "{{.Name}}").split()
    assert serve(installed, ("prefill", "r2"), ("decode", "r2")), versions_ready(installed)
    assert installed.complete().status_code == 200
    record = installed.record(NODE_B, "decode")
    assert record["current"]["version"] == "r2" and record["previous"]["version"] == "r1"


def test_rollback_restores_the_previous_release(installed: Serving) -> None:
    rollback = installed.play("rollback.yml", "-e", f"@{installed.release_vars('r2', '2')}")
    assert rollback.returncode == 0, rollback.output[-5000:]
    assert installed.record(NODE_B, "decode")["current"] == {
        "image": installed.image,
        "version": "r1",
        "config_version": "1",
    }
    assert serve(installed, ("prefill", "r1"), ("decode", "r1")), versions_ready(installed)
    weights = installed.internal.get(
        f"{installed.scheduler()}/v1/admin/weights", headers=admin(installed), timeout=5
    ).json()["weights"]
    assert weights == {"r1": 100}
    assert installed.complete().status_code == 200


def test_a_corrupt_model_stops_the_rollout_before_any_server_restarts(installed: Serving) -> None:
    weights = installed.model_source / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        bad = installed.play("serving.yml", "--skip-tags", "prometheus", "-e", f"@{installed.release_vars('r3', '3')}")
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
        state = installed.node(
            NODE_B, "podman", "inspect", "--format", "{{.State.Pid}} {{.State.Health.Status}}", "pdserve-decode"
        ).split()
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
