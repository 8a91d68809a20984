"""The local environment's CA and its certificates (#17), made on this machine by `up` and kept across runs.

One CA per checkout (`.cache/local/tls/ca.crt`, its key beside it), and one certificate per node carrying the node's
names (pdstack.local.names: gateway, scheduler and prometheus on the control node, the pool's and its own name on a
server) and its address: the servers register with the scheduler and open the KV channel by address, so callers
check the address too. Each leaf allows serverAuth and clientAuth, so under mutual TLS the same pair identifies the
node to its peers (docs/tls.md). Same key type and lifetimes as the cloud's (infra/certificates.py).

Keys are 0600 files in a 0700 folder, never printed; the playbooks hand them to the nodes as podman secrets. A
certificate is issued again when its names or address change, when it was not signed by the current CA, or when it
is within RENEW_BEFORE of expiring; otherwise a second `up` changes nothing (and so replaces no container).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import exceptions, x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdstack.contract.components import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE

CA_VALIDITY = datetime.timedelta(days=3650)
VALIDITY = datetime.timedelta(days=180)
RENEW_BEFORE = datetime.timedelta(days=45)
ORGANIZATION = "pdstack"


@dataclass(frozen=True)
class Leaf:
    """What one certificate must carry."""

    name: str  # its files' folder: the node's name
    dns_names: tuple[str, ...]  # the first is the common name
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class LocalCA:
    folder: Path

    @property
    def ca_cert(self) -> Path:
        """The CA certificate a client verifies the environment with (`httpx.Client(verify=...)`, SSL_CERT_FILE)."""
        return self.folder / TLS_CA_FILE

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    def cert(self, name: str) -> Path:
        return self.folder / name / TLS_CERT_FILE

    def key(self, name: str) -> Path:
        return self.folder / name / TLS_KEY_FILE

    def forget(self, name: str) -> None:
        """Remove a leaf's certificate and key (a node gone for good)."""
        shutil.rmtree(self.folder / name, ignore_errors=True)

    def ensure(self, leaves: list[Leaf], now: datetime.datetime | None = None) -> list[str]:
        """The CA (made once) and a current certificate for every leaf; the names of those (re)issued."""
        now = now or datetime.datetime.now(datetime.UTC)
        _private_dir(self.folder)
        if not (self.ca_cert.is_file() and self.ca_key.is_file()):
            self._make_ca(now)
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        issued = []
        for leaf in leaves:
            if not self._current(leaf, ca, now):
                self._issue(leaf, ca, ca_key, now)
                issued.append(leaf.name)
        return issued

    def _make_ca(self, now: datetime.datetime) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, "pdstack local CA"),
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            ]
        )
        usage = x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=True,
            crl_sign=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        _write_private(self.ca_key, _key_pem(key))
        _write_public(self.ca_cert, cert.public_bytes(serialization.Encoding.PEM))

    def _current(self, leaf: Leaf, ca: x509.Certificate, now: datetime.datetime) -> bool:
        if not (self.cert(leaf.name).is_file() and self.key(leaf.name).is_file()):
            return False
        cert = x509.load_pem_x509_certificate(self.cert(leaf.name).read_bytes())
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, exceptions.InvalidSignature):
            return False
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(san.get_values_for_type(x509.DNSName))
        addresses = tuple(str(a) for a in san.get_values_for_type(x509.IPAddress))
        return (names, addresses) == (leaf.dns_names, leaf.addresses) and cert.not_valid_after_utc - now > RENEW_BEFORE

    def _issue(
        self, leaf: Leaf, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, now: datetime.datetime
    ) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, leaf.dns_names[0]),
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            ]
        )
        san = x509.SubjectAlternativeName(
            [
                *(x509.DNSName(n) for n in leaf.dns_names),
                *(x509.IPAddress(ipaddress.ip_address(a)) for a in leaf.addresses),
            ]
        )
        usage = x509.KeyUsage(
            digital_signature=True,
            key_encipherment=True,
            key_cert_sign=False,
            crl_sign=False,
            content_commitment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )
        eku = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(eku, critical=False)
            .add_extension(san, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _private_dir(self.folder / leaf.name)
        _write_private(self.key(leaf.name), _key_pem(key))
        _write_public(self.cert(leaf.name), cert.public_bytes(serialization.Encoding.PEM))


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _write_public(path: Path, data: bytes) -> None:
    """A certificate: no secret, but written as 0600 too, like everything in the folder (its folder is 0700)."""
    _write_private(path, data)
