"""End to end on the local environment, in the order an operator meets it: `pdstack local up` from the stacks, TLS on
every listener, a completion across the emulated WAN and its trace, a decode container killed under client load, a
decode node added from its pool's user data and removed through a drain under load, and `up` again (nothing changes).
What judges time (canaries, a WAN loss spike), a certificate rotation and `down` follow in test_local_timed.py, on
the environment this module leaves up as a warm `up` finds it unchanged.

These tests own the machine's local environment (fixed names and addresses from stacks/Pulumi.local-*.yaml).
"""

from __future__ import annotations

import ast
import json
import re
import ssl
import time
from pathlib import Path
from urllib.parse import urlsplit

import certifi
import httpx
import pytest
from openai import APIConnectionError, DefaultHttpxClient, OpenAI

from pdstack.contract.components import Component
from pdstack.contract.node_lifecycle import node_group_name
from pdstack.local import groups, nodes
from pdstack.local.commands import run_captured
from pdstack.node.apply import VARS_FILE
from pdstack.node.loader import STATE_DIR
from pdstack.node.release import read_release
from tests.local.alerting import assert_a_restarted_decode_reaches_the_webhook
from tests.local.environment import (
    LOAD_RATE,
    Local,
    assert_a_killed_decode_recovers,
    assert_a_warm_up_changes_nothing,
    metric_sum,
    pdstack,
    wan_bytes,
)
from tests.local.listeners import listening, probe
from tests.local.load import LONG_PROMPT, ClientLoad
from tests.pdstack.local.test_model import WORDS
from tests.support import REPO
from tests.support.otlp import Span, receiving

pytestmark = pytest.mark.timeout(3600)


def test_up_prints_the_endpoint_the_key_file_and_prometheus(local: Local) -> None:
    port = local.contract[Component.GATEWAY].port
    assert local.status["gateway_url"] == f"https://gateway.control.local.pdstack:{port}/v1"
    assert f"gateway:    {local.status['gateway_url']}" in local.up_output
    assert f"CA:         {local.status['ca_file']}" in local.up_output
    assert f"client:     {local.status['client_cert']}" in local.up_output
    assert f"API key:    in {local.status['api_key_file']}" in local.up_output
    assert f"Prometheus: {local.status['prometheus_url']}" in local.up_output
    assert local.api_key() not in local.up_output  # where the key lives, never the key
    printed = re.search(r"^completion: (.+)$", local.up_output, re.MULTILINE)
    assert printed, local.up_output[-2000:]
    completion = ast.literal_eval(printed[1])
    assert WORDS.fullmatch(completion.lstrip(".,!? ")), completion  # the model's words, through the gateway
    by_dc = {dc: sorted(n["role"] for n in members) for dc, members in local.status["nodes"].items()}
    assert by_dc == {"control": ["control"], "dc1": ["prefill", "prefill"], "dc2": ["decode", "decode"]}
    assert all(n["running"] for members in local.status["nodes"].values() for n in members)


def test_up_booted_every_gpu_node_as_an_instance_of_its_pools_group(local: Local) -> None:
    """`up` brings the prefill and decode nodes up as the cloud does: each an instance of its pool's Auto Scaling
    group that bootstrapped itself from the pool's user data into the release `up` published, and joined the
    scheduler as that instance."""
    asg = local.env.aws().client("autoscaling")
    release = read_release(local.env.aws().client("ssm"), groups.ENV).release
    assert release == local.release()["version"]
    routed = {i["instance_id"]: i for i in local.instances() if i["state"] == "ready"}
    for node in [n for n in local.topology.nodes if n.role.needs_gpu]:
        group = node_group_name(groups.ENV, node.datacenter, node.pool)
        members = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[group])["AutoScalingGroups"][0]["Instances"]
        metrics = nodes.exec_in_node(node.name, ["cat", groups.METRICS])
        assert "pdstack_node_bootstrap_failed 0" in metrics and f'release="{release}"' in metrics, metrics
        joined = json.loads(nodes.exec_in_node(node.name, ["cat", str(STATE_DIR / VARS_FILE)]))["pdstack_engine_id"]
        assert joined in {m["InstanceId"] for m in members}, (node.name, joined, members)
        assert routed[f"{node.role}-{joined}"]["info"]["version"] == release


def test_the_openai_client_reaches_the_gateway_over_https_by_name_verifying_the_local_ca(local: Local) -> None:
    verified = DefaultHttpxClient(verify=ssl.create_default_context(cafile=local.status["ca_file"]))
    client = OpenAI(base_url=local.status["gateway_url"], api_key=local.api_key(), timeout=60, http_client=verified)
    completion = client.completions.create(model=local.topology.serving.model.name, prompt="TLS by name", max_tokens=4)
    assert completion.choices[0].text


def test_a_client_without_the_local_ca_refuses_the_gateway_in_its_own_tls_check(local: Local) -> None:
    public_cas = DefaultHttpxClient(verify=ssl.create_default_context(cafile=certifi.where()))
    client = OpenAI(
        base_url=local.status["gateway_url"], api_key=local.api_key(), timeout=30, max_retries=0, http_client=public_cas
    )
    with pytest.raises(APIConnectionError) as refused:
        client.models.list()
    assert "CERTIFICATE_VERIFY_FAILED" in repr(causes(refused.value))


def test_plain_http_to_the_gateway_gets_no_http_answer(local: Local) -> None:
    plain = f"http://gateway.control.local.pdstack:{local.contract[Component.GATEWAY].port}/v1/models"
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        httpx.get(plain, headers={"Authorization": f"Bearer {local.api_key()}"}, timeout=15)


# What still listens in plaintext on the nodes, and why: sshd (Ansible's own transport, its own encryption).
PLAINTEXT_LISTENERS = {22: "sshd"}


def test_every_pdserve_listener_on_every_node_serves_tls_and_refuses_plaintext(local: Local) -> None:
    """With the stack's mutual TLS, every listener but the gateway's also refuses a client without a certificate
    (the KV channel's too: it asks for one once it has a CA)."""
    assert local.topology.serving.mutual_tls
    pdserve_ports = {c.port for c in local.contract.components.values()} | set(
        local.contract[Component.PREFILL].kv_ports
    )
    client = (Path(local.status["client_cert"]), Path(local.status["client_key"]))
    probed = [
        probe(node.namespace, address, port, Path(local.status["ca_file"]), client)
        for node in local.topology.nodes
        for address, port in listening(node.namespace, str(node.address.ip))
    ]
    store_port, exporter_port = local.contract.ratelimit_store.port, local.contract.node_exporter.port
    prometheus_port, alertmanager_port = local.contract.prometheus.port, local.contract.alertmanager.port
    others = {store_port, exporter_port, prometheus_port, alertmanager_port} | set(PLAINTEXT_LISTENERS)
    unknown = [p for p in probed if p.port not in pdserve_ports | others]
    assert not unknown, unknown
    # the gateways' rate-limit store (Redis) on the control node: TLS only, a client certificate required
    (store,) = [p for p in probed if p.port == store_port]
    assert store.tls == "ok" and not store.answers_plaintext and store.refuses_anonymous_tls, store
    # node_exporter on every node, Prometheus and Alertmanager on the control node: likewise (a plaintext request
    # gets Go's 400 for HTTP to an HTTPS server)
    exporters = [p for p in probed if p.port == exporter_port]
    assert len(exporters) == len(local.topology.nodes), exporters
    (prometheus,) = [p for p in probed if p.port == prometheus_port]
    (alertmanager,) = [p for p in probed if p.port == alertmanager_port]
    go_servers = [*exporters, prometheus, alertmanager]
    assert all(p.tls == "ok" and p.refuses_anonymous_tls and p.refuses_plaintext_http for p in go_servers), go_servers
    served = [p for p in probed if p.port in pdserve_ports]
    # gateway and scheduler on the control node, each prefill's HTTP and KV ports, each decode's HTTP port
    assert len(served) == 2 + 2 * 2 + 2, served
    assert all(p.tls == "ok" and not p.answers_plaintext_http for p in served), served
    gateway = local.contract[Component.GATEWAY].port
    assert all(p.anonymous_tls == "ok" for p in served if p.port == gateway), served
    internal = [p for p in served if p.port != gateway]
    assert all(p.refuses_anonymous_tls for p in internal), internal


def causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def test_prometheus_scrapes_every_pdserve_component_and_node(local: Local) -> None:
    query = f"{local.status['prometheus_url']}/api/v1/query"
    deadline = time.monotonic() + 60
    while True:
        answer = local.internal.get(query, params={"query": 'up{job=~"pdserve-.*|node"}'}, timeout=10)
        result = answer.json()["data"]["result"]
        up = {(r["metric"]["job"], r["metric"]["instance"]): r["value"][1] for r in result}
        if (len(up) == 11 and set(up.values()) == {"1"}) or time.monotonic() > deadline:
            break
        time.sleep(2)
    # scheduler, gateway, 2 prefill, 2 decode, and node_exporter on each of the 5 nodes
    assert len(up) == 11 and set(up.values()) == {"1"}, up
    clocks = local.internal.get(query, params={"query": "node_timex_sync_status"}, timeout=10).json()["data"]["result"]
    assert len(clocks) == 5  # what the clock-skew alert reads
    started = {"query": 'process_start_time_seconds{job=~"pdserve-.*"}'}
    processes = local.internal.get(query, params=started, timeout=10).json()["data"]["result"]
    assert len(processes) == 6  # what the restart alert reads, from every pdserve component


def test_a_completion_is_prefilled_in_dc1_and_decoded_in_dc2_across_the_wan(local: Local) -> None:
    ready = [i for i in local.instances() if i["state"] == "ready"]
    prefill_hosts = {i["info"]["url"].split("//")[1].split(":")[0] for i in ready if i["info"]["role"] == "prefill"}
    decode_hosts = {i["info"]["url"].split("//")[1].split(":")[0] for i in ready if i["info"]["role"] == "decode"}
    assert all(h.startswith("10.210.1.") for h in prefill_hosts) and len(prefill_hosts) == 2
    assert all(h.startswith("10.210.2.") for h in decode_hosts) and len(decode_hosts) == 2

    kv_before = metric_sum(local.gateway_metrics(), "pdserve_gateway_kv_transfer_bytes_sum")
    wan_before = wan_bytes(local, "dc1", "dc2")
    client = OpenAI(base_url=local.status["gateway_url"], api_key=local.api_key(), timeout=60)
    completion = client.completions.create(
        model=local.topology.serving.model.name, prompt=LONG_PROMPT, max_tokens=8, temperature=0
    )
    assert completion.choices[0].text
    metrics = local.gateway_metrics()
    kv_moved = metric_sum(metrics, "pdserve_gateway_kv_transfer_bytes_sum") - kv_before
    assert kv_moved > 0, "decode reported no KV pulled for a prompt past the offload threshold"
    assert wan_bytes(local, "dc1", "dc2") - wan_before >= kv_moved  # the KV crossed the dc1 -> dc2 WAN link
    assert metric_sum(metrics, "pdserve_gateway_routing_decisions_total", role="prefill", reason="remote_prefill") > 0


def test_a_completion_is_one_trace_across_both_datacenters(local: Local) -> None:
    """The local stack's serving.tracing sends every component's spans to a receiver here: one completion is one
    trace from the gateway through prefill in dc1, the KV pull over the WAN and its serving side, to decode in dc2."""
    endpoint = urlsplit(local.topology.serving.tracing.otlp_endpoint)
    with receiving(endpoint.hostname, endpoint.port) as receiver:
        client = OpenAI(base_url=local.status["gateway_url"], api_key=local.api_key(), timeout=60)
        client.completions.create(
            model=local.topology.serving.model.name,
            prompt=LONG_PROMPT,
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Request-Id": "local-trace-1"},
        )
        deadline = time.monotonic() + 60
        while not (spans := traced_request(receiver.spans, "local-trace-1")):
            assert time.monotonic() < deadline, [(s.service, s.name) for s in receiver.spans]
            time.sleep(1)
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent in by_id for s in spans if s.parent), "a span's parent is missing from the trace"
    assert {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"} <= {s.service for s in spans}
    (pull,) = [s for s in spans if s.name == "kv pull"]
    assert by_id[pull.parent].service == "pdserve-decode" and pull.attributes["pdserve.kv.bytes"] > 0
    assert {s.service for s in spans if s.name == "kv serve" and s.parent == pull.span_id} == {"pdserve-prefill"}


def traced_request(spans: list[Span], request_id: str) -> list[Span]:
    """The trace whose gateway span carries `request_id`, once decode's pull and prefill's side of it arrived."""
    roots = [s for s in spans if s.attributes.get("pdserve.request_id") == request_id and not s.parent]
    trace = [s for s in spans if roots and s.trace_id == roots[0].trace_id]
    return trace if {"kv pull", "kv serve"} <= {s.name for s in trace} else []


def test_a_killed_decode_container_is_restarted_and_requests_recover(local: Local) -> None:
    assert_a_killed_decode_recovers(local, "pdserve-decode", restart_s=180)


def test_the_restarted_decode_alert_reaches_a_webhook_through_alertmanager(local: Local) -> None:
    """Right after the kill above: its PdstackContainerRestarting goes Prometheus -> Alertmanager -> webhook."""
    assert_a_restarted_decode_reaches_the_webhook(local)


def test_a_decode_node_launched_from_user_data_takes_traffic_and_leaves_through_a_drain(local: Local) -> None:
    """Under load, `pdstack local scale dc2 decode 3`: the pool's group gives an instance id, the node boots from the
    pool's user data alone into the release the fleet runs (a promoted canary's, when one ran), joins, and the
    gateway routes to it; then `scale dc2 decode 2` drains it on itself and removes it. No request fails at any
    point."""
    decode = local.contract[Component.DECODE].port
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        out = pdstack("local", "scale", "dc2", "decode", "3", "--json")
        assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
        launched = json.loads(out.stdout)["launched"]
        assert [n["node"] for n in launched] == ["dc2-decode-3"], launched
        assert {"boot", "release", "secrets", "join", "registry", "model", "apply"} <= set(launched[0]["seconds"])
        assert set(launched[0]["apply"]) == {"image", "roles", "engine_start"}, launched[0]
        model = read_release(local.env.aws().client("ssm"), groups.ENV).model
        assert launched[0]["model_bytes"] == sum(f.size for f in model.files)  # every byte from the bucket
        assert_an_anonymous_pull_is_refused_on("dc2-decode-3")
        assert_the_operators_reach(local, "dc2-decode-3", "pdserve-decode")
        instance = f"decode-{launched[0]['instance_id']}"
        routed = {i["instance_id"]: i for i in local.instances()}
        assert routed[instance]["state"] == "ready" and routed[instance]["info"]["url"].endswith(f":{decode}")
        assert routed[instance]["info"]["version"] == local.baseline()  # the release the fleet runs, canaries included
        deadline = time.monotonic() + 120
        while metric_sum(local.gateway_metrics(), "pdserve_gateway_routing_decisions_total", instance=instance) < 3:
            assert time.monotonic() < deadline, f"the gateway sent {instance} no share of the load"
            time.sleep(2)
        out = pdstack("local", "scale", "dc2", "decode", "2", "--json")
        assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
        assert json.loads(out.stdout)["removed"] == ["dc2-decode-3"]
        time.sleep(5)
    assert instance not in {i["instance_id"] for i in local.instances()}  # deregistered by its drain
    assert not nodes.node_exists("dc2-decode-3")
    assert load.completed() > 50 and not load.failures(), load.failures()


def assert_an_anonymous_pull_is_refused_on(node: str) -> None:
    """The node's image came through an authenticated pull: the same pull on the node without its credentials is
    refused by the registry."""
    applied = json.loads(nodes.exec_in_node(node, ["cat", str(STATE_DIR / VARS_FILE)]))
    image = applied["pdstack_images"]["decode"]
    anonymous = f"echo '{{}}' > /tmp/anonymous.json && podman pull --authfile /tmp/anonymous.json {image}"
    pulled = run_captured(["podman", "exec", node, "sh", "-c", anonymous], check=False)
    assert pulled.returncode != 0 and "unauthorized" in (pulled.stdout + pulled.stderr).lower(), pulled.stderr


def assert_the_operators_reach(local: Local, node: str, container: str) -> None:
    """The operators' plays reach a node the group launched: the local inventory lists it (in its pool's group) and
    their key lets them in, as the AWS inventory and its SSM sessions reach a cloud node the group launched."""
    ansible = str(REPO / ".venv" / "bin" / "ansible")
    command = f"podman container exists {container}"
    argv = [ansible, "-i", str(local.env.inventory), f"decode:&{node}", "-m", "ansible.builtin.command", "-a", command]
    reached = local.operator(argv)
    assert reached.returncode == 0 and f"{node} | CHANGED" in reached.stdout, reached.stdout + reached.stderr


def test_up_again_changes_nothing(local: Local) -> None:
    """Last: after the killed decode and the scaling above, the environment is still what `up` left (the module
    after this one starts from it with a warm `up`)."""
    assert_a_warm_up_changes_nothing(local.env, local.topology)
