"""Real PEM files for tests that start or check what the program renders: under Pulumi mocks its Secrets hold
stand-ins (pdstack.synth.synthesis), which neither pdserve nor promtool can load, so these take their place on disk."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdstack.contract.components import TLS_CA_FILE, TLS_CERT_FILE, TLS_DIR, TLS_KEY_FILE


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
    names: list[str],
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
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def write_tls_dir(folder: Path, names: list[str]) -> Path:
    """A CA and a certificate for `names` signed by it, as the files of a kubernetes.io/tls Secret in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test CA", ca_key, None, [])
    leaf = _cert(names[0], key, ("test CA", ca_key), names)
    pem = serialization.Encoding.PEM
    (folder / TLS_CA_FILE).write_bytes(ca.public_bytes(pem))
    (folder / TLS_CERT_FILE).write_bytes(leaf.public_bytes(pem))
    (folder / TLS_KEY_FILE).write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder


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
