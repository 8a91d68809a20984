"""Real PEM files for tests that start or check what the program renders: under Pulumi mocks its Secrets hold
stand-ins (pdstack.synth.synthesis), which neither pdserve nor promtool can load, so these take their place on disk;
and a CA that issues as many certificates as a test needs (new_ca, issue: certificate rotation)."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdstack.contract.components import TLS_CA_FILE, TLS_CERT_FILE, TLS_DIR, TLS_KEY_FILE


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    names: Sequence[str],
    usages: Sequence[x509.ObjectIdentifier] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signer = issuer or (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _general_name(name: str) -> x509.GeneralName:
    """An IP address SAN for an address, a DNS name SAN otherwise."""
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _write_pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert_file: Path, key_file: Path) -> None:
    pem = serialization.Encoding.PEM
    cert_file.write_bytes(cert.public_bytes(pem))
    key_file.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def write_tls_dir(folder: Path, names: list[str]) -> Path:
    """A CA and a certificate for `names` signed by it, as the files of a kubernetes.io/tls Secret in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test CA", ca_key, None, [])
    leaf = _cert(names[0], key, ("test CA", ca_key), names)
    (folder / TLS_CA_FILE).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_pair(leaf, key, folder / TLS_CERT_FILE, folder / TLS_KEY_FILE)
    return folder


def new_ca(folder: Path, name: str = "test CA") -> tuple[Path, Path]:
    """A self-signed CA, written to folder/ca.pem and its key to folder/ca.key."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert_file, key_file = folder / "ca.pem", folder / "ca.key"
    _write_pair(_cert(name, key, None, []), key, cert_file, key_file)
    return cert_file, key_file


def issue(
    ca: tuple[Path, Path], folder: Path, name: str, names: Sequence[str] = ("localhost", "127.0.0.1")
) -> tuple[Path, Path]:
    """A certificate for `names` (DNS names or IP addresses) signed by the CA `ca` (new_ca's files), for servers and
    clients, written to folder/name.pem and its key to folder/name.key; its serial is fresh, so a test can tell two
    issues apart."""
    ca_cert = x509.load_pem_x509_certificate(ca[0].read_bytes())
    ca_key = serialization.load_pem_private_key(ca[1].read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    issuer = ca_cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    key = ec.generate_private_key(ec.SECP256R1())
    usages = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    cert = _cert(names[0], key, (str(issuer), ca_key), names, usages)
    cert_file, key_file = folder / f"{name}.pem", folder / f"{name}.key"
    _write_pair(cert, key, cert_file, key_file)
    return cert_file, key_file


def serial_of(cert: Path) -> int:
    return int(x509.load_pem_x509_certificate(cert.read_bytes()).serial_number)


def relocated(value: str, folder: Path) -> str:
    """`value` with the container's TLS_DIR replaced by `folder`."""
    return value.replace(f"{TLS_DIR}/", f"{folder}/")


def self_signed_localhost(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 (openssl's), and its key, written in `folder`."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
