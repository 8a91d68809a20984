"""The local environment's CA, its per-node certificates and its names (pdstack.local.tls, pdstack.local.names):
real handshakes on loopback against the files `up` writes."""

from __future__ import annotations

import datetime
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from pdstack.local import names
from pdstack.local.names import hosts_block, remove_hosts, write_hosts
from pdstack.local.tls import RENEW_BEFORE, VALIDITY, Leaf, LocalCA
from pdstack.local.topology import load_topology
from tests.support import REPO

LEAF = Leaf("control-control-1", ("gateway.control.local.pdstack", "scheduler.control.local.pdstack"), ("127.0.0.1",))


@pytest.fixture
def ca(tmp_path: Path) -> LocalCA:
    local = LocalCA(tmp_path / "tls")
    assert local.ensure([LEAF]) == [LEAF.name]
    return local


def serve_once(ca: LocalCA, leaf: str) -> Iterator[int]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(ca.cert(leaf), ca.key(leaf))
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        conn, _ = listener.accept()
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    thread.join(5)
    listener.close()


@pytest.fixture
def served(ca: LocalCA) -> Iterator[int]:
    yield from serve_once(ca, LEAF.name)


def handshake(port: int, server_name: str, cafile: Path | None) -> bytes:
    context = ssl.create_default_context(cafile=str(cafile) if cafile else None)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        return tls.recv(2)


def test_a_client_with_the_ca_verifies_a_node_by_name(ca: LocalCA, served: int) -> None:
    assert handshake(served, "gateway.control.local.pdstack", ca.ca_cert) == b"ok"


def test_a_client_with_the_ca_verifies_a_node_by_address(ca: LocalCA, served: int) -> None:
    assert handshake(served, "127.0.0.1", ca.ca_cert) == b"ok"


def test_a_client_without_the_ca_refuses_the_node(ca: LocalCA, served: int) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        handshake(served, "gateway.control.local.pdstack", None)


def test_a_name_the_certificate_does_not_carry_is_refused(ca: LocalCA, served: int) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        handshake(served, "prefill.dc1.local.pdstack", ca.ca_cert)


def test_keys_are_private_and_a_second_ensure_issues_nothing(ca: LocalCA) -> None:
    for path in (ca.ca_key, ca.key(LEAF.name)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(ca.folder.stat().st_mode) == 0o700
    before = ca.cert(LEAF.name).read_bytes(), ca.ca_cert.read_bytes()
    assert ca.ensure([LEAF]) == []
    assert (ca.cert(LEAF.name).read_bytes(), ca.ca_cert.read_bytes()) == before


def test_a_forgotten_leaf_leaves_nothing_and_is_issued_afresh(ca: LocalCA) -> None:
    """A node a group launched and then removed takes its certificate and key with it (scale-in leaves the folder
    as it was, so a warm `up` sees nothing changed)."""
    ca.forget(LEAF.name)
    assert sorted(p.name for p in ca.folder.iterdir()) == ["ca.crt", "ca.key"]
    assert ca.ensure([LEAF]) == [LEAF.name]


def test_a_leaf_serves_and_identifies_a_client(ca: LocalCA) -> None:
    cert = x509.load_pem_x509_certificate(ca.cert(LEAF.name).read_bytes())
    uses = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u.dotted_string for u in uses} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}  # serverAuth, clientAuth
    assert cert.subject.rfc4514_string().startswith("O=pdstack,CN=gateway.control.local.pdstack")


def test_a_changed_address_a_new_ca_or_a_near_expiry_issues_again(ca: LocalCA) -> None:
    moved = Leaf(LEAF.name, LEAF.dns_names, ("127.0.0.2",))
    assert ca.ensure([moved]) == [LEAF.name]
    late = datetime.datetime.now(datetime.UTC) + VALIDITY - RENEW_BEFORE + datetime.timedelta(days=1)
    assert ca.ensure([moved], now=late) == [LEAF.name]
    ca.ca_cert.unlink()
    assert ca.ensure([moved]) == [LEAF.name]  # a new CA: every leaf is signed by it again


def test_every_node_gets_its_names_and_address_and_the_control_node_the_issues_gateway_name() -> None:
    topology = load_topology(REPO / "stacks")
    leaves = {leaf.name: leaf for leaf in names.leaves(topology)}
    assert set(leaves) == {node.name for node in topology.nodes}
    control = leaves["control-control-1"]
    assert control.dns_names[:3] == (
        "gateway.control.local.pdstack",
        "scheduler.control.local.pdstack",
        "prometheus.control.local.pdstack",
    )
    prefill = leaves["dc1-prefill-1"]
    assert prefill.dns_names == ("prefill.dc1.local.pdstack", "dc1-prefill-1.prefill.dc1.local.pdstack")
    assert prefill.addresses == ("10.210.1.10",)
    control_address = str(names.control_node(topology).address.ip)
    assert names.host_entries(topology)["gateway.control.local.pdstack"] == control_address


def test_the_hosts_block_is_written_once_replaced_and_removed_leaving_the_rest(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.1 other")
    assert write_hosts({"gateway.control.local.pdstack": "10.210.0.10"}, hosts)
    assert not write_hosts({"gateway.control.local.pdstack": "10.210.0.10"}, hosts)
    assert write_hosts({"gateway.control.local.pdstack": "10.210.0.11"}, hosts)
    text = hosts.read_text()
    block = hosts_block({"gateway.control.local.pdstack": "10.210.0.11"})
    assert text == "127.0.0.1 localhost\n10.0.0.1 other\n" + block
    assert text.count(names.BEGIN) == 1
    assert remove_hosts(hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.1 other\n"
    assert not remove_hosts(hosts)
