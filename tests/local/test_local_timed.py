"""End to end on the local environment, the part that judges time, on a quiet machine (the Makefile runs it after the
other lanes): a good canary promoted and bad ones rolled back under client load (the judge compares latencies), a
loss spike on the WAN (every request ends within its timeout); then a certificate rotated on one node by the serving
play alone (it changes what `up` reads, so after it only a converge would call the environment unchanged), the
dashboards' queries after all that traffic, and `down` leaving nothing behind. Its `up` finds the environment
test_local_env.py left, unchanged (or brings one up).

These tests own the machine's local environment (fixed names and addresses from stacks/Pulumi.local-*.yaml).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from cryptography import x509

from pdstack.contract.components import Component
from pdstack.local import nodes
from pdstack.local.names import leaves
from pdstack.local.transport import local_ca
from tests.local.environment import (
    LOAD_RATE,
    Local,
    assert_back_on,
    assert_down_leaves_nothing,
    assert_promoted_under_load,
    pdstack,
)
from tests.local.load import ClientLoad
from tests.local.operator import operator_context
from tests.support.dashboardcheck import query_problems

pytestmark = pytest.mark.timeout(3600)


def test_a_good_canary_is_promoted_to_all_traffic_with_no_failed_request(local: Local) -> None:
    assert_promoted_under_load(local, "good", "2", engine="pdserve")


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


def test_every_dashboard_query_returns_series_after_the_traffic(local: Local) -> None:
    """After test_local_env.py's completions, killed decode and scaling, and the canaries and the loss spike above:
    each panel query of monitoring/dashboards runs on the environment's Prometheus and (unless it reads vllm:
    metrics) returns series. The window spans the whole run (the other lanes ran between the two modules)."""
    prometheus = local.status["prometheus_url"]
    problems = query_problems(prometheus, window_s=3600, step_s=30, verify=operator_context(local.status))
    assert problems == [], "\n".join(problems)


def test_down_leaves_no_container_namespace_link_or_rule(local: Local) -> None:
    assert_down_leaves_nothing(local)
