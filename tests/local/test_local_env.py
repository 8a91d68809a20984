"""End to end on the local environment, in the order an operator meets it: `pdstack local up` from the stacks, a
completion across the emulated WAN, `up` again (nothing changes), a good canary promoted and bad ones rolled back
under client load, a killed decode container, a loss spike on the WAN, a decode node added from its pool's user data
and removed through a drain under load, and `down` leaving nothing behind.

These tests own the machine's local environment (fixed names and addresses from stacks/Pulumi.local-*.yaml).
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import certifi
import httpx
import pytest
from cryptography import x509
from openai import APIConnectionError, DefaultHttpxClient, OpenAI

from pdstack.bench.endpoint import Endpoint
from pdstack.contract.components import Component, Contract, contract
from pdstack.local import nodes
from pdstack.local.converged import running_containers
from pdstack.local.env import LocalEnv
from pdstack.local.names import leaves
from pdstack.local.network import namespaces
from pdstack.local.topology import Topology
from pdstack.local.transport import local_ca
from pdstack.model import PoolRole
from tests.local.alerting import assert_a_restarted_decode_reaches_the_webhook
from tests.local.listeners import listening, probe
from tests.local.load import LONG_PROMPT, ClientLoad
from tests.local.operator import operator_context
from tests.pdstack.local.test_model import WORDS
from tests.support import REPO
from tests.support.ansible import RECAP
from tests.support.dashboardcheck import query_problems
from tests.support.otlp import Span, receiving

PDSTACK = str(REPO / ".venv" / "bin" / "pdstack")
LOAD_RATE = 5.0  # requests/s: what the local stack's canary policy (min_samples 10 at a 20 % step) is sized for

pytestmark = pytest.mark.timeout(3600)


def pdstack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PDSTACK, *args], capture_output=True, text=True, cwd=REPO, check=False)


@dataclass
class Local:
    env: LocalEnv
    topology: Topology
    up_output: str
    status: dict[str, Any]

    @property
    def control(self) -> str:
        return str(self.status["gateway_url"]).split("//")[1].split(":")[0]

    def api_key(self) -> str:
        return Path(self.status["api_key_file"]).read_text().strip()

    def endpoint(self) -> Endpoint:
        """The gateway's completions, of the model `up` deployed (the engine's: pdserve's or vLLM's)."""
        return Endpoint(self.status["gateway_url"], "completions", self.status["model"], self.api_key())

    def gateway_metrics(self) -> str:
        """The gateway's /metrics, as Prometheus reads it: presenting the metrics token (without it: 401)."""
        token = self.env.secrets.metrics_scrape_token.read_text().strip()
        url = f"https://{self.control}:{self.contract[Component.GATEWAY].port}/metrics"
        assert httpx.get(url, timeout=10).status_code == 401, "the gateway's /metrics answers without its token"
        response = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert response.status_code == 200, response.text
        return response.text

    @property
    def contract(self) -> Contract:
        return contract(self.topology.serving)

    @property
    def scheduler(self) -> str:
        return str(self.status["scheduler_url"])

    @cached_property
    def internal(self) -> httpx.Client:
        """A client of the scheduler's, the servers' and Prometheus' APIs (tests/local/operator.py)."""
        return httpx.Client(verify=operator_context(self.status))

    def scheduler_admin(self) -> dict[str, str]:
        """The scheduler's read endpoints need a token (the gateway's or the admin's): the tests read as admin."""
        return {"Authorization": f"Bearer {self.env.secrets.scheduler_admin_token.read_text().strip()}"}

    def instances(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.internal.get(
            f"{self.scheduler}/v1/instances", headers=self.scheduler_admin(), timeout=10
        ).json()["instances"]
        return found

    def weights(self) -> dict[str, int]:
        weights: dict[str, int] = self.internal.get(
            f"{self.scheduler}/v1/admin/weights", headers=self.scheduler_admin(), timeout=10
        ).json()["weights"]
        return weights

    def release(self) -> dict[str, Any]:
        release: dict[str, Any] = json.loads(self.env.release_file.read_text())["pdstack_release"]
        return release

    def record(self, node: str, component: str) -> dict[str, Any]:
        text = nodes.exec_in_node(node, ["cat", f"/var/lib/pdstack/pdserve/{component}.release.json"])
        record: dict[str, Any] = json.loads(text)
        return record

    def running_release(self, node: str, component: str) -> list[str]:
        """The -e arguments of the release the node runs now (a canary test's, once promoted): a play with them
        changes only what the test changes."""
        path = self.env.state_dir / f"release-{self.record(node, component)['current']['version']}.json"
        return ["-e", f"@{path}"] if path.exists() else []

    def servers(self) -> list[tuple[str, str]]:
        """(node, component) of every prefill and decode server."""
        return [(n.name, str(n.role)) for n in self.topology.nodes if str(n.role) in ("prefill", "decode")]

    def versions(self) -> dict[str, str]:
        """The release version each server's record says it runs, by node."""
        return {node: self.record(node, component)["current"]["version"] for node, component in self.servers()}

    def baseline(self) -> str:
        """The one release every server runs: what a canary test starts from, whatever ran before it."""
        running = set(self.versions().values())
        assert len(running) == 1, f"servers run different releases: {self.versions()}"
        return running.pop()

    def deploy(
        self, version: str, config_version: str, settings: dict[str, Any] | None = None, **release: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run playbooks/deploy.yml for a release of the current image with this version and config; `settings`:
        extra vars the release changes too (with vLLM, the rendered command lines `pdstack_vllm_vars`)."""
        path = self.env.state_dir / f"release-{version}.json"
        release = {**self.release(), "version": version, "config_version": config_version, **release}
        path.write_text(json.dumps({"pdstack_release": release, **(settings or {})}))
        argv = self.env.playbook_argv("deploy.yml", "-e", f"@{path}")
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            cwd=REPO,
            check=False,
            env={
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "HOME": str(self.env.state_dir),
                "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
                "ANSIBLE_NOCOLOR": "1",
            },
        )


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wan_bytes(local: Local, a: str, b: str) -> int:
    """Bytes received by datacenter `b`'s router from its WAN link to `a` (the forwarder's TUN device)."""
    dc_b = local.topology.datacenter(b)
    link = next(lk for lk in local.topology.links if {lk.a, lk.b} == {a, b})
    shown = subprocess.run(
        ["ip", "-n", dc_b.router_namespace, "-s", "-j", "link", "show", link.device_towards(a)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(shown)[0]["stats64"]["rx"]["bytes"])


def brought_up(*up_args: str) -> Iterator[Local]:
    """`pdstack local up` with these arguments, then the environment as the tests see it."""
    up = pdstack("local", "up", *up_args)
    assert up.returncode == 0, (up.stdout + up.stderr)[-6000:]
    status = json.loads(pdstack("local", "status", "--json").stdout)
    env = LocalEnv(REPO)
    # Every client here (httpx, the openai client, the load and the bench) verifies the environment's CA, as
    # docs/local.md tells a user to; the TLS tests below build their clients explicitly instead.
    before = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = status["ca_file"]
    try:
        yield Local(env, env.topology(), up.stdout + up.stderr, status)
    finally:
        if before is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = before


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    yield from brought_up()


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


def test_up_again_changes_nothing(local: Local) -> None:
    assert_a_warm_up_changes_nothing(local.env, local.topology)


def assert_a_warm_up_changes_nothing(env: LocalEnv, topology: Topology, *up_args: str) -> None:
    """A warm up skips the playbooks (#19): nothing they read changed, and every node runs what they left. That a
    second converge changes nothing is tests/roles' and tests/deploy's (test_second_run_changes_nothing, ...)."""
    release = env.release_file.read_text()
    names = [n.name for n in topology.nodes]
    before = running_containers(names)
    again = pdstack("local", "up", *up_args)
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    assert "ansible: skipped playbooks/site.yml on every node" in again.stderr, again.stderr[-3000:]
    assert not RECAP.search(again.stdout + again.stderr)  # no play ran
    assert running_containers(names) == before  # not a container replaced
    assert env.release_file.read_text() == release  # same images by digest, same config


def test_a_good_canary_is_promoted_to_all_traffic_with_no_failed_request(local: Local) -> None:
    assert_promoted_under_load(local, "good", "2", engine="pdserve")


def fresh_version(name: str) -> str:
    """A release version no earlier deploy used (deploy.yml refuses a release its canary nodes already run)."""
    return f"{name}-{secrets.token_hex(4)}"


def assert_promoted_under_load(local: Local, name: str, build: str, engine: str) -> None:
    """A new release (`name` and a suffix of its own) deployed under load passes its canary and replaces the release
    every server ran, on every server and for all traffic, no request failing."""
    baseline, version = local.baseline(), fresh_version(name)
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        deployed = local.deploy(version, build)
    assert deployed.returncode == 0, deployed.stdout[-6000:]
    assert f"release {version} promoted" in deployed.stdout
    assert load.completed() > 50 and not load.failures(), load.failures()
    for node, component in local.servers():
        record = local.record(node, component)
        current = record["current"]
        assert (current["version"], current.get("stack", {}).get("engine", "pdserve")) == (version, engine), node
        assert record["previous"]["version"] == baseline, node
    assert local.weights() == {version: 100}


@pytest.mark.parametrize(
    ("version", "fault", "failing_check"),
    [
        ("slow-3", {"PDSERVE_FAULT_DELAY_MS": "600"}, "FAIL ttft_p95"),
        # caught by the golden prompts before the canary gets any traffic; a canary that fails its golden prompts
        # with errors takes the same gate and rollback (its report: tests/pdstack/canary/test_golden.py)
        ("wrong-4", {"PDSERVE_FAULT_PERTURB_OUTPUT": "true"}, "golden"),
    ],
)
def test_a_bad_canary_is_rolled_back_and_the_report_names_the_check(
    local: Local, version: str, fault: dict[str, str], failing_check: str
) -> None:
    baseline = local.baseline()
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        deployed = local.deploy(version, version, env=fault)
    output = deployed.stdout + deployed.stderr
    assert deployed.returncode != 0
    assert f"canary {version} rolled back" in output and failing_check in output, output[-6000:]
    assert not load.failures(), load.failures()  # slowness and wrong text are what clients of the canary got
    assert_back_on(local, baseline, version)


def assert_back_on(local: Local, baseline: str, canary: str) -> None:
    """Every server runs `baseline` again, which takes all traffic; the rolled-back `canary` takes none."""
    versions = local.versions()
    assert set(versions.values()) == {baseline}, versions
    weights = local.weights()
    assert (weights.get(baseline), weights.get(canary, 0)) == (100, 0), weights


def served_serial(namespace: str, address: str, port: int, ca: str) -> int:
    """The serial of the certificate a listener serves now (a fresh handshake, from inside the node's namespace)."""
    code = (
        "import socket, ssl, sys; c = ssl.create_default_context(cafile=sys.argv[3]); "
        "s = c.wrap_socket(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5), "
        "server_hostname=sys.argv[1]); print(s.getpeercert(binary_form=True).hex())"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", code, address, str(port), ca],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return x509.load_der_x509_certificate(bytes.fromhex(out.strip())).serial_number


def test_a_certificate_rotated_on_one_decode_node_is_served_without_a_failed_request(local: Local) -> None:
    """A new certificate for dc2-decode-1, deployed by the serving play, is picked up by the running server (a
    reload: the container is not replaced) while requests flow through the gateway to it."""
    node = local.topology.datacenter("dc2").nodes[0]
    port, ca = local.contract[Component.DECODE].port, local.status["ca_file"]
    before = served_serial(node.namespace, str(node.address.ip), port, ca)
    container = nodes.exec_in_node(node.name, ["podman", "inspect", "--format", "{{.Id}}", "pdserve-decode"]).strip()
    tls = local_ca(local.env.state_dir)
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        time.sleep(5)
        tls.cert(node.name).unlink()  # the next `ensure` issues it again: a new key and serial
        assert tls.ensure(leaves(local.topology)) == [node.name]
        new = x509.load_pem_x509_certificate(tls.cert(node.name).read_bytes()).serial_number
        running = local.running_release(node.name, "decode")
        local.env.play("serving.yml", *running, "--tags", "decode", "--limit", node.name, say=lambda line: None)
        deadline = time.monotonic() + 30
        while (served := served_serial(node.namespace, str(node.address.ip), port, ca)) != new:
            assert time.monotonic() < deadline, f"still serving serial {served} (before {before}, new {new})"
            time.sleep(1)
        time.sleep(5)
    assert load.completed() > 20 and not load.failures(), load.failures()
    again = nodes.exec_in_node(node.name, ["podman", "inspect", "--format", "{{.Id}}", "pdserve-decode"]).strip()
    assert again == container  # reloaded in place, not restarted


def test_a_killed_decode_container_is_restarted_and_requests_recover(local: Local) -> None:
    assert_a_killed_decode_recovers(local, "pdserve-decode", restart_s=180)


def assert_a_killed_decode_recovers(local: Local, container: str, restart_s: float) -> None:
    """Under load, the first decode node's `container` is killed: podman restarts it, it is healthy again within
    `restart_s`, the requests after that all succeed, and the gateway carried the others on the other decode."""
    node = local.topology.nodes_with_role(PoolRole.DECODE)[0].name
    pid = nodes.exec_in_node(node, ["podman", "inspect", "--format", "{{.State.Pid}}", container]).strip()
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        time.sleep(5)
        nodes.exec_in_node(node, ["kill", "-KILL", pid])
        deadline = time.monotonic() + restart_s
        while time.monotonic() < deadline:
            now = nodes.exec_in_node(
                node, ["podman", "inspect", "--format", "{{.State.Pid}} {{.State.Health.Status}}", container]
            ).split()
            if now[0] not in ("0", pid) and now[1:] == ["healthy"]:
                break
            time.sleep(2)
        else:
            raise AssertionError(f"{container} was not restarted and healthy within {restart_s:.0f} s")
        recovered_at = time.perf_counter()
        time.sleep(15)
    results = load.results
    after = [r for r in results if r.start_s > recovered_at - load.started_at + 5]
    assert after and all(r.ok for r in after), [r.detail for r in after if not r.ok]
    # The gateway retries a failed decode on the other one; at most the streams cut off mid-way fail.
    assert sum(not r.ok for r in results) <= 0.1 * len(results), load.failures()


def test_the_restarted_decode_alert_reaches_a_webhook_through_alertmanager(local: Local) -> None:
    """Right after the kill above: its PdstackContainerRestarting goes Prometheus -> Alertmanager -> webhook."""
    assert_a_restarted_decode_reaches_the_webhook(local)


def test_a_loss_spike_on_the_wan_ends_every_request_within_its_timeout(local: Local) -> None:
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE, timeout_s=45) as load:
        time.sleep(5)
        shaped = pdstack("local", "link", "dc1", "dc2", "--loss-pct", "30")
        assert shaped.returncode == 0, shaped.stderr
        time.sleep(15)
        reset = pdstack("local", "link", "dc1", "dc2", "--reset")
        assert reset.returncode == 0, reset.stderr
        time.sleep(20)
    # stop() asserted nothing hangs; each request either completed or failed with a cause the client can act on
    for result in load.results:
        assert result.ok or result.error in ("timeout", "http_5xx", "stream_error", "overload"), result.detail
    last = [r for r in load.results if r.start_s >= load.results[-1].start_s - 10]
    assert last and all(r.ok for r in last), [r.detail for r in last if not r.ok]


def test_a_decode_node_launched_from_user_data_takes_traffic_and_leaves_through_a_drain(local: Local) -> None:
    """Under load, `pdstack local scale dc2 decode 3`: the pool's group gives an instance id, the node boots from the
    pool's user data alone into the release the fleet runs (the canary promoted above), joins, and the gateway routes
    to it; then `scale dc2 decode 2` drains it on itself and
    removes it. No request fails at any point."""
    decode = local.contract[Component.DECODE].port
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        out = pdstack("local", "scale", "dc2", "decode", "3", "--json")
        assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
        launched = json.loads(out.stdout)["launched"]
        assert [n["node"] for n in launched] == ["dc2-decode-3"], launched
        assert {"boot", "release", "secrets", "join", "registry", "model", "apply"} <= set(launched[0]["seconds"])
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


def test_every_dashboard_query_returns_series_after_the_traffic(local: Local) -> None:
    """After the cross-DC completions, the canaries, the killed decode and the loss spike above: each panel query of
    monitoring/dashboards runs on the environment's Prometheus and (unless it reads vllm: metrics) returns series."""
    prometheus = local.status["prometheus_url"]
    problems = query_problems(prometheus, window_s=1200, step_s=30, verify=operator_context(local.status))
    assert problems == [], "\n".join(problems)


def test_down_leaves_no_container_namespace_link_or_rule(local: Local) -> None:
    assert_down_leaves_nothing(local)


def assert_down_leaves_nothing(local: Local) -> None:
    """`pdstack local down` removes every node, namespace, link, rule, the registry and the names' hosts block."""
    down = pdstack("local", "down")
    assert down.returncode == 0, down.stderr[-3000:]
    assert not any(nodes.node_exists(n.name) for n in local.topology.nodes)
    assert not [ns for ns in namespaces() if ns.startswith("pds")]
    assert local.env.network(local.topology).leftovers() == []
    assert "netem" not in subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=False).stdout
    assert not local.env.registry().healthy()
    assert "local.pdstack" not in Path("/etc/hosts").read_text()  # the names' block is gone, the rest stays
