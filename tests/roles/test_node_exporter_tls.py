"""roles/node_exporter under the stack's TLS (#17) on a converged node: baseline.yml given a release's TLS folder
(pdstack_tls_dir, with the local stack's mutual TLS) serves HTTPS with the node's own pair, refuses a client without a
certificate and plain HTTP, and serves a rotated certificate without a restart."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Iterator

import httpx
import pytest
import testinfra
from cryptography import x509

from pdstack.local import nodes
from pdstack.local.tls import Leaf, LocalCA
from tests.roles.conftest import NODE_B, Cluster
from tests.support.ansible import PlaybookRun

pytestmark = pytest.mark.timeout(900)
CLIENT = "client"  # Prometheus' part: any pair from the CA


def leaves() -> list[Leaf]:
    return [Leaf(NODE_B, (f"{NODE_B}.test",), (nodes.node_address(NODE_B),)), Leaf(CLIENT, ("client.test",), ())]


def converge(cluster: Cluster, tls: LocalCA | None) -> PlaybookRun:
    """The baseline's node_exporter on node B, with the release's TLS folder (the local environment's) or without."""
    release = ["-e", "pdstack_environment=local", "-e", f"pdstack_tls_dir={tls.folder}"] if tls else []
    run = cluster.playbook("--tags", "node_exporter", "--limit", NODE_B, *release)
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.fixture(scope="module")
def tls(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCA]:
    ca = LocalCA(tmp_path_factory.mktemp("node-exporter") / "tls")
    ca.ensure(leaves())
    converge(cluster, ca)
    yield ca
    converge(cluster, None)  # plain HTTP again, as the other role tests expect


def url() -> str:
    return f"https://{nodes.node_address(NODE_B)}:9100/metrics"


def context(ca: LocalCA, client: bool = True) -> ssl.SSLContext:
    verify = ssl.create_default_context(cafile=str(ca.ca_cert))
    if client:
        verify.load_cert_chain(ca.cert(CLIENT), ca.key(CLIENT))
    return verify


def served_serial(ca: LocalCA) -> int:
    address = nodes.node_address(NODE_B)
    with (
        socket.create_connection((address, 9100), timeout=10) as raw,
        context(ca).wrap_socket(raw, server_hostname=address) as wrapped,
    ):
        der = wrapped.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def main_pid() -> str:
    node = testinfra.get_host(f"podman://{NODE_B}")
    return str(node.check_output("systemctl show --property MainPID --value prometheus-node-exporter"))


def test_node_exporter_serves_https_to_a_client_with_a_certificate_from_the_ca(tls: LocalCA) -> None:
    metrics = httpx.get(url(), verify=context(tls), timeout=10)
    assert metrics.status_code == 200 and "node_timex_sync_status" in metrics.text
    node = testinfra.get_host(f"podman://{NODE_B}")
    key = node.file("/etc/pdstack/node_exporter/tls.key")
    assert (key.user, key.group, key.mode) == ("root", "prometheus", 0o440)
    assert (
        "--web.config.file=/etc/pdstack/node_exporter/web.yml"
        in node.file("/etc/default/prometheus-node-exporter").content_string
    )


def test_node_exporter_refuses_a_client_without_a_certificate_and_plain_http(tls: LocalCA) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(url(), verify=context(tls, client=False), timeout=10)
    plain = httpx.get(url().replace("https://", "http://"), timeout=10)
    assert plain.status_code == 400 and "node_" not in plain.text  # Go's answer to HTTP on a TLS port: no metrics


def test_a_second_run_with_tls_changes_nothing(cluster: Cluster, tls: LocalCA) -> None:
    assert converge(cluster, tls).recap(NODE_B)["changed"] == 0


def test_a_rotated_certificate_is_served_without_a_restart(cluster: Cluster, tls: LocalCA) -> None:
    before, pid = served_serial(tls), main_pid()
    tls.cert(NODE_B).unlink()  # the next ensure issues it again: a new key and serial
    assert tls.ensure(leaves()) == [NODE_B]
    new = x509.load_pem_x509_certificate(tls.cert(NODE_B).read_bytes()).serial_number
    converge(cluster, tls)
    assert served_serial(tls) == new != before
    assert main_pid() == pid
