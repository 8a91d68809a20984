"""TLS for every pdserve HTTP listener and client: one settings model, the contexts built from it, and rotation.

Every component's settings carry the same fields (PDSERVE_TLS_CERT, ...; docs/tls.md): `server_context` builds its
listener's SSLContext, `client_context` the one its httpx clients verify servers with (and present a client
certificate from, for mutual TLS).

Rotation: every context built here is watched by RELOADER. `reloading()` (run by the listener, and by the agent)
checks the files every `tls_reload_seconds` and at once on SIGHUP. Polling the files' identity (device, inode, size,
mtime) catches every way a certificate gets replaced (an Ansible copy, a kubelet's symlink swap of a mounted secret,
certbot) with no hook in the deploy; SIGHUP lets a deploy that knows when it is done make it immediate. A changed
pair is read once, loaded onto a scratch context first and only then onto the live one (load_cert_chain on the same
SSLContext): a half-written pair (new certificate, old key) would otherwise leave the live context with a
certificate and no key, since OpenSSL drops the old key as soon as a certificate that does not match it is loaded.
Reloads run on the event loop thread, the one that also runs this process's handshakes, so no handshake sees a
context between its two loads. Connections already open keep the certificate they were made with; new handshakes,
served and made, get the new one.

The KV channel makes its handshakes on its own threads, so its contexts are built and rotated differently
(pdserve.common.kv_tls).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import ssl
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

log = logging.getLogger("pdserve.tls")
ClientAuth = Literal["none", "optional", "required"]
VERIFY_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
FileStamp = tuple[int, int, int, int] | None


class TLSFileError(ValueError):
    """A TLS file cannot be used; the message names its setting."""


class TLSClientSettings(BaseModel):
    """What a component needs to call https servers: the CA it trusts and its own client certificate."""

    tls_ca: Path | None = Field(
        None,
        description="PEM CA bundle peers are verified against: the https servers this component calls, and its "
        "listener's clients under tls_client_auth optional/required; unset, outbound calls trust the system's CAs",
    )
    tls_client_cert: Path | None = Field(
        None, description="PEM certificate chain presented on outbound https calls (mutual TLS)"
    )
    tls_client_key: Path | None = Field(None, description="PEM private key of tls_client_cert")
    tls_reload_seconds: float = Field(
        5.0, gt=0, description="seconds between checks of the TLS files for a rotated certificate (SIGHUP: at once)"
    )

    @model_validator(mode="after")
    def _client_pair(self) -> TLSClientSettings:
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("tls_client_cert and tls_client_key: give both or neither")
        return self


class TLSSettings(TLSClientSettings):
    """The TLS fields of every component with a listener (gateway, scheduler, model servers)."""

    tls_cert: Path | None = Field(
        None, description="PEM certificate chain the listener presents; unset, it serves plain HTTP"
    )
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_client_auth: ClientAuth = Field(
        "none",
        description="mutual TLS on the listener: none | optional (a client certificate, if presented, must chain to "
        "tls_ca) | required (clients without one are refused in the handshake)",
    )

    @model_validator(mode="after")
    def _server_pair(self) -> TLSSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if self.tls_client_auth != "none" and self.tls_cert is None:
            raise ValueError(f"tls_client_auth: {self.tls_client_auth} needs the listener's tls_cert and tls_key")
        if self.tls_client_auth != "none" and self.tls_ca is None:
            raise ValueError(f"tls_client_auth: {self.tls_client_auth} needs tls_ca to verify client certificates")
        return self

    @property
    def tls_on(self) -> bool:
        return self.tls_cert is not None

    @property
    def scheme(self) -> str:
        """How callers reach this component's listener."""
        return "https" if self.tls_on else "http"


def server_context(settings: TLSSettings) -> ssl.SSLContext | None:
    """The listener's context (TLS 1.2+), watched for rotation; None when no certificate is set."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    ca = None
    if settings.tls_client_auth != "none":
        ca = settings.tls_ca
        load_ca(context, ca, "tls_ca")
        context.verify_mode = VERIFY_MODES[settings.tls_client_auth]
    load_pair(context, settings.tls_cert, settings.tls_key, "tls_cert", "tls_key")
    RELOADER.watch(context, "listener", settings.tls_cert, settings.tls_key, ca)
    return context


def client_context(settings: TLSClientSettings) -> ssl.SSLContext:
    """What outbound httpx clients verify servers with (`verify=`): tls_ca, or the system's CAs; presenting
    tls_client_cert when set. Host names are checked."""
    context = ssl.create_default_context()
    if settings.tls_ca is not None:
        try:
            context = ssl.create_default_context(cadata=_read(settings.tls_ca, "tls_ca").decode("ascii", "replace"))
        except ssl.SSLError as error:
            raise TLSFileError(f"tls_ca {settings.tls_ca}: not a PEM CA bundle ({error.reason or error})") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.tls_client_cert is not None and settings.tls_client_key is not None:
        load_pair(context, settings.tls_client_cert, settings.tls_client_key, "tls_client_cert", "tls_client_key")
        RELOADER.watch(context, "client", settings.tls_client_cert, settings.tls_client_key, settings.tls_ca)
    elif settings.tls_ca is not None:
        RELOADER.watch(context, "client", None, None, settings.tls_ca)
    return context


def check_files(settings: TLSClientSettings) -> None:
    """Load every TLS file the settings name onto throwaway contexts: a TLSFileError naming the setting of the first
    that cannot be used, before a slow start (a model load) rather than after it."""
    if isinstance(settings, TLSSettings) and settings.tls_cert is not None and settings.tls_key is not None:
        load_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), settings.tls_cert, settings.tls_key, "tls_cert", "tls_key")
    if settings.tls_ca is not None:
        load_ca(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), settings.tls_ca, "tls_ca")
    if settings.tls_client_cert is not None and settings.tls_client_key is not None:
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        load_pair(client, settings.tls_client_cert, settings.tls_client_key, "tls_client_cert", "tls_client_key")


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise TLSFileError(f"{setting} {path}: {error.strerror}") from None


def load_ca(context: ssl.SSLContext, path: Path | None, setting: str) -> None:
    assert path is not None
    try:
        context.load_verify_locations(cadata=_read(path, setting).decode("ascii", "replace"))
    except ssl.SSLError as error:
        raise TLSFileError(f"{setting} {path}: not a PEM CA bundle ({error.reason or error})") from None


def load_pair(context: ssl.SSLContext, cert: Path, key: Path, cert_setting: str, key_setting: str) -> None:
    pair = _read(cert, cert_setting), _read(key, key_setting)
    try:
        _load_pair_bytes(context, *pair)
    except ssl.SSLError as error:
        raise TLSFileError(
            f"{cert_setting} {cert} / {key_setting} {key}: not a matching PEM certificate and key "
            f"({error.reason or error})"
        ) from None


def _load_pair_bytes(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """load_cert_chain from bytes read once: checked on a scratch context before the live one is touched."""
    with _pem_files(cert_pem, key_pem) as (cert_path, key_path):
        ssl.SSLContext(context.protocol).load_cert_chain(cert_path, key_path)
        context.load_cert_chain(cert_path, key_path)


@contextlib.contextmanager
def _pem_files(*contents: bytes) -> Iterator[list[str]]:
    """Paths OpenSSL can read `contents` from: anonymous memory files (the key never lands on a disk), or files in
    a private temporary folder where memfd_create is missing."""
    if hasattr(os, "memfd_create"):
        fds = [os.memfd_create("pdserve-tls", os.MFD_CLOEXEC) for _ in contents]
        try:
            for fd, data in zip(fds, contents, strict=True):
                os.write(fd, data)
            yield [f"/proc/self/fd/{fd}" for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as folder:
        paths = [os.path.join(folder, str(index)) for index in range(len(contents))]
        for path, data in zip(paths, contents, strict=True):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as out:
                out.write(data)
        yield paths


def fingerprint(cert_pem: bytes) -> str:
    """sha256 of the leaf certificate's DER, for logs (identifies which certificate is served)."""
    text = cert_pem.decode("ascii", "replace")
    end = text.find("-----END CERTIFICATE-----")
    if end < 0:
        return "unknown"
    der = ssl.PEM_cert_to_DER_cert(text[: end + len("-----END CERTIFICATE-----")] + "\n")
    return "sha256:" + hashlib.sha256(der).hexdigest()


@dataclass
class _Watched:
    context: ssl.SSLContext
    role: str
    cert: Path | None
    key: Path | None
    ca: Path | None
    stamp: tuple[FileStamp, ...] = ()
    failed: tuple[FileStamp, ...] = ()

    def files(self) -> list[Path]:
        return [path for path in (self.cert, self.key, self.ca) if path is not None]


def file_stamp(paths: list[Path]) -> tuple[FileStamp, ...]:
    stamps: list[FileStamp] = []
    for path in paths:
        try:
            info = path.stat()
        except OSError:
            stamps.append(None)
            continue
        stamps.append((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
    return tuple(stamps)


@dataclass
class CertificateReloader:
    """The contexts of this process and their files; `check()` reloads those whose files changed."""

    watched: list[_Watched] = field(default_factory=list)

    def watch(self, context: ssl.SSLContext, role: str, cert: Path | None, key: Path | None, ca: Path | None) -> None:
        entry = _Watched(context, role, cert, key, ca)
        entry.stamp = file_stamp(entry.files())
        self.watched.append(entry)

    def check(self) -> int:
        """Reload every context whose files changed since it was last loaded; the number reloaded."""
        reloaded = 0
        for entry in self.watched:
            stamp = file_stamp(entry.files())
            if stamp != entry.stamp and self._reload(entry, stamp):
                reloaded += 1
        return reloaded

    def _reload(self, entry: _Watched, stamp: tuple[FileStamp, ...]) -> bool:
        """Load the changed files onto the live context; on any problem keep what it has and try at the next check
        (a pair being written one file at a time matches once both are)."""
        fields = {
            "role": entry.role,
            **{name: str(path) for name, path in (("cert", entry.cert), ("ca", entry.ca)) if path},
        }
        try:
            if entry.ca is not None:
                ca_pem = entry.ca.read_bytes().decode("ascii", "replace")
                ssl.SSLContext(entry.context.protocol).load_verify_locations(cadata=ca_pem)
            if entry.cert is not None and entry.key is not None:
                cert_pem = entry.cert.read_bytes()
                _load_pair_bytes(entry.context, cert_pem, entry.key.read_bytes())
                fields["fingerprint"] = fingerprint(cert_pem)
            if entry.ca is not None:
                entry.context.load_verify_locations(cadata=ca_pem)  # adds: CAs loaded before stay trusted
        except (OSError, ssl.SSLError, ValueError) as error:
            if stamp != entry.failed:
                entry.failed = stamp
                log.warning(
                    "TLS files changed but cannot be loaded yet; serving the previous certificate",
                    extra={"fields": {**fields, "cause": str(error)}},
                )
            return False
        entry.stamp, entry.failed = stamp, ()
        log.info("TLS certificate reloaded", extra={"fields": fields})
        return True

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.check()


RELOADER = CertificateReloader()


@contextlib.asynccontextmanager
async def reloading(interval: float) -> AsyncIterator[CertificateReloader]:
    """While inside: RELOADER checks every `interval` seconds and on SIGHUP, on the running loop."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(RELOADER.run(interval), name="pdserve-tls-reload")
    hooked = False
    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread: polling only
        loop.add_signal_handler(signal.SIGHUP, RELOADER.check)
        hooked = True
    try:
        yield RELOADER
    finally:
        task.cancel()
        if hooked:
            loop.remove_signal_handler(signal.SIGHUP)
        await asyncio.gather(task, return_exceptions=True)
