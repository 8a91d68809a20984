"""The KV channel over TLS between vLLM instances: prefill serves its KV port with a certificate, decode verifies
it against a CA; the output still equals colocated, and a plain-TCP client gets no KV from the TLS port."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.kv import KVTransferError, pull
from pdserve.kv.auth import SecretKey
from tests.vllm.conftest import MAX_TOKENS, Pair, loaded, prompt_of, start_pair, token_ids


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it, with the openssl command line."""
    paths = {name: folder / f"{name}.pem" for name in ("ca", "ca-key", "server", "server-key", "server-csr")}

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=pdstack test CA",
        "-keyout",
        str(paths["ca-key"]),
        "-out",
        str(paths["ca"]),
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        str(paths["server-key"]),
        "-out",
        str(paths["server-csr"]),
    )
    extensions = folder / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        "x509",
        "-req",
        "-in",
        str(paths["server-csr"]),
        "-CA",
        str(paths["ca"]),
        "-CAkey",
        str(paths["ca-key"]),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(extensions),
        "-out",
        str(paths["server"]),
    )
    return paths


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def pair(
    model_dir: Path,
    kv_key_file: Path,
    kv_key: SecretKey,
    tmp_path_factory: pytest.TempPathFactory,
    certificates: dict[str, Path],
) -> Iterator[Pair]:
    prefill_tls = {"kv_tls_cert": str(certificates["server"]), "kv_tls_key": str(certificates["server-key"])}
    decode_tls = {"kv_tls_ca": str(certificates["ca"])}
    yield from start_pair(
        model_dir, kv_key_file, kv_key, tmp_path_factory, "fail", prefill_extra=prefill_tls, decode_extra=decode_tls
    )


def test_kv_over_tls_gives_the_colocated_output(pair: Pair) -> None:
    prompt = prompt_of(100, seed=30)
    colocated = token_ids(pair.prefill.complete(prompt, MAX_TOKENS))
    params = pair.prefill_params(prompt)
    assert token_ids(pair.decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)) == colocated
    assert loaded(pair, params["remote_request_id"])


def test_tls_port_serves_no_plain_tcp_and_no_unknown_ca(pair: Pair, tmp_path: Path) -> None:
    params = pair.prefill_params(prompt_of(40, seed=31))
    request_id, checksum = params["remote_request_id"], params["kv_checksum"]
    with pytest.raises(KVTransferError):
        asyncio.run(pull("127.0.0.1", pair.kv_port, request_id, checksum, key=pair.key, retries=0))
    stranger = make_certificates(tmp_path)  # another CA, which did not sign prefill's certificate
    with pytest.raises(KVTransferError) as refused:
        asyncio.run(
            pull(
                "127.0.0.1",
                pair.kv_port,
                request_id,
                checksum,
                key=pair.key,
                retries=0,
                ssl_context=ssl.create_default_context(cafile=str(stranger["ca"])),
            )
        )
    assert refused.value.cause == "auth"
    trusted = ssl.create_default_context(cafile=str(pair.decode.extra["kv_tls_ca"]))
    blob = asyncio.run(pull("127.0.0.1", pair.kv_port, request_id, checksum, key=pair.key, ssl_context=trusted))
    assert blob.meta.token_count == 40
