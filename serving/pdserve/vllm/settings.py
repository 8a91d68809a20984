"""The connector's settings: vLLM's `kv_connector_extra_config`, checked once, with errors naming the key.

Pure Python (no vLLM, no torch), so the keys and their defaults can be read and tested without vLLM installed.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.common.kv_tls import RotatingContext, kv_client_context, kv_server_context
from pdserve.kv.auth import SecretKey
from pdserve.kv.params import derive_params_key

_KNOWN = {
    "kv_key_file",
    "advertise_host",
    "bind_host",
    "port",
    "streams",
    "bytes_per_stream",
    "lease_seconds",
    "connect_timeout_seconds",
    "read_timeout_seconds",
    "transfer_timeout_seconds",
    "open_wait_seconds",
    "store_bytes",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "tls_server_name",
    "tls_reload_seconds",
    "run_dir",
    "kv_cpus",
    "release_version",
}
RELEASE_VERSION = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # as roles/pdserve and roles/vllm_engine take a version


class SettingsError(ValueError):
    """A bad kv_connector_extra_config; the message starts with the key."""


def kv_port_of(base: int, *, dp_index: int, tp_size: int, tp_rank: int) -> int:
    """The one rule for where a prefill worker serves its KV shard: `port` (kv_connector_extra_config, the stack's
    KV port) is data-parallel engine 0's tensor-parallel rank 0; engine d's rank r listens on
    base + d * tp_size + r. An instance of TP t x DP d therefore holds the t * d ports [base, base + t * d), and
    kv_transfer_params name the answering engine's rank-0 port (decode rank r pulls from remote_port + r).
    pdstack renders the same range into the security groups (pdstack.contract.kv_port_range)."""
    return base + dp_index * tp_size + tp_rank


def kv_ports_used(tp_size: int, dp_size: int) -> int:
    """How many consecutive ports from `port` an instance of TP tp_size x DP dp_size listens on (see kv_port_of)."""
    return tp_size * dp_size


@dataclass(frozen=True)
class ConnectorSettings:
    key: SecretKey
    advertise_host: str
    bind_host: str
    base_port: int  # kv_connector_extra_config.port: DP engine 0's TP rank 0 (see kv_port_of)
    streams: int
    bytes_per_stream: int
    lease_seconds: float
    connect_timeout_seconds: float
    read_timeout_seconds: float
    transfer_timeout_seconds: float
    open_wait_seconds: float
    store_bytes: int
    tls_cert: str | None
    tls_key: str | None
    tls_ca: str | None
    tls_server_name: str | None
    tls_reload_seconds: float  # how often a handshake checks the TLS files for a rotated certificate
    run_root: Path  # kv_connector_extra_config.run_dir
    engine_id: str
    kv_cpus: frozenset[int] | None  # None: the forward thread's (see pdserve.vllm.worker.connector_cpus)
    tp_size: int = 1
    data_parallel: bool = False  # one of several DP engines of an instance (see pdserve.vllm.connector)
    dp_index: int = 0  # vLLM's parallel_config.data_parallel_index: which DP engine of the instance this is
    tp_rank: int = 0  # this worker's tensor-parallel rank (0 in the scheduler process)

    @property
    def port(self) -> int:
        """This worker's KV port (prefill); for rank 0, the one kv_transfer_params name as remote_port."""
        if self.base_port == 0:  # decode: binds nothing
            return 0
        return kv_port_of(self.base_port, dp_index=self.dp_index, tp_size=self.tp_size, tp_rank=self.tp_rank)

    @property
    def run_dir(self) -> Path:
        """This worker's own directory (its port makes it unique per rank and DP engine): results, instance.json."""
        return self.run_root / f"{self.engine_id}-{self.port}"

    def streams_for(self, pull_bytes: int) -> int:
        """Streams for a pull of `pull_bytes`: one per bytes_per_stream, at most `streams`. A small pull on one
        stream keeps one congestion window open: split over 4 pooled connections, each stream's window covers a
        quarter of what one warm connection's does, and the last layer's chunk (what decode waits for once prefill
        ends) can wait a round trip for acknowledgements (bench/vllm_ttft, 2 MiB at 512 tokens: 1.07-1.14x the
        bound on 1 stream, 1.10-1.25x on 4)."""
        return max(1, min(self.streams, -(-pull_bytes // self.bytes_per_stream)))

    def for_rank(self, tp_rank: int) -> ConnectorSettings:
        if not 0 <= tp_rank < self.tp_size:
            raise SettingsError(f"tp_rank: {tp_rank} is not a rank of tensor_parallel_size {self.tp_size}")
        return replace(self, tp_rank=tp_rank)

    @property
    def params_key(self) -> bytes:
        """Signs (prefill) and verifies (decode) kv_transfer_params; the gateway holds only this derived key."""
        return derive_params_key(self.key.material)

    def server_tls(self) -> RotatingContext | None:
        """TLS for prefill's KV listener; with tls_ca too, clients must present a certificate signed by it."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        ca = Path(self.tls_ca) if self.tls_ca else None
        return kv_server_context(Path(self.tls_cert), Path(self.tls_key), ca, self.tls_reload_seconds, "tls_")

    def client_tls(self) -> RotatingContext | None:
        """TLS for decode's pulls: the prefill certificate must chain to tls_ca (decode's own cert if given)."""
        if self.tls_ca is None:
            return None
        cert, key = (Path(self.tls_cert), Path(self.tls_key)) if self.tls_cert and self.tls_key else (None, None)
        return kv_client_context(Path(self.tls_ca), cert, key, self.tls_reload_seconds, "tls_")


def parse(
    extra: dict[str, Any],
    *,
    producer: bool,
    engine_id: str,
    tp_size: int = 1,
    dp_index: int = 0,
    data_parallel: bool = False,
) -> ConnectorSettings:
    """Settings from kv_connector_extra_config (and vLLM's parallel layout); raises SettingsError naming the first
    bad key."""
    unknown = sorted(set(extra) - _KNOWN)
    if unknown:
        raise SettingsError(f"kv_connector_extra_config.{unknown[0]}: unknown key (known: {', '.join(sorted(_KNOWN))})")
    key_file = extra.get("kv_key_file")
    if not key_file:
        raise SettingsError("kv_connector_extra_config.kv_key_file: required (the KV channel's shared key)")
    try:
        key = SecretKey.from_file(str(key_file))
    except ValueError as error:
        raise SettingsError(f"kv_connector_extra_config.kv_key_file: {error}") from None
    advertise_host = str(extra.get("advertise_host", "127.0.0.1"))
    port = _number(extra, "port", 0, int)
    if producer and not 0 < port < 65536:
        # The scheduler process names the port in kv_transfer_params, but the worker binds it: it must be fixed.
        raise SettingsError("kv_connector_extra_config.port: a prefill (kv_producer) needs a fixed port in 1..65535")
    if tp_size < 1 or dp_index < 0:
        raise SettingsError(f"parallel_config: tensor_parallel_size {tp_size}, data_parallel_index {dp_index}")
    last = kv_port_of(port, dp_index=dp_index, tp_size=tp_size, tp_rank=tp_size - 1)
    if producer and last > 65535:
        raise SettingsError(
            f"kv_connector_extra_config.port: {port}: DP engine {dp_index}'s {tp_size} TP ranks would listen up to "
            f"{last} (one port per worker, see kv_port_of), above 65535"
        )
    tls_cert, tls_key = _optional(extra, "tls_cert"), _optional(extra, "tls_key")
    if (tls_cert is None) != (tls_key is None):
        raise SettingsError("kv_connector_extra_config.tls_cert: tls_cert and tls_key go together")
    run_dir = Path(str(extra.get("run_dir", Path(tempfile.gettempdir()) / "pdstack-vllm")))
    release_version(extra)
    settings = ConnectorSettings(
        key=key,
        advertise_host=advertise_host,
        bind_host=str(extra.get("bind_host", advertise_host)),
        base_port=port,
        streams=_number(extra, "streams", 4, int),
        bytes_per_stream=_number(extra, "bytes_per_stream", 32 << 20, int),
        lease_seconds=_number(extra, "lease_seconds", 30.0, float),
        connect_timeout_seconds=_number(extra, "connect_timeout_seconds", 5.0, float),
        read_timeout_seconds=_number(extra, "read_timeout_seconds", 10.0, float),
        transfer_timeout_seconds=_number(extra, "transfer_timeout_seconds", 120.0, float),
        open_wait_seconds=_number(extra, "open_wait_seconds", 10.0, float),
        store_bytes=_number(extra, "store_bytes", 1 << 30, int),
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_ca=_optional(extra, "tls_ca"),
        tls_server_name=_optional(extra, "tls_server_name"),
        tls_reload_seconds=_number(extra, "tls_reload_seconds", 5.0, float),
        run_root=run_dir,
        engine_id=engine_id,
        kv_cpus=_cpu_list(extra),
        tp_size=tp_size,
        data_parallel=data_parallel,
        dp_index=dp_index,
    )
    positive = ("streams", "bytes_per_stream", "lease_seconds", "connect_timeout_seconds", "read_timeout_seconds",
                "store_bytes", "tls_reload_seconds")  # fmt: skip
    for name in positive:
        if getattr(settings, name) <= 0:
            raise SettingsError(f"kv_connector_extra_config.{name}: must be positive")
    if settings.open_wait_seconds < 0:
        raise SettingsError("kv_connector_extra_config.open_wait_seconds: must be 0 or more")
    return settings


def release_version(extra: dict[str, Any]) -> str | None:
    """The release the engine serves (`release_version`, set by pdstack's deploy), or None outside a deploy."""
    version = extra.get("release_version")
    if version is not None and not (isinstance(version, str) and RELEASE_VERSION.match(version)):
        raise SettingsError(f"kv_connector_extra_config.release_version: 1-64 of A-Z a-z 0-9 . _ -, got {version!r}")
    return version


def _number(extra: dict[str, Any], name: str, default: float, kind: type) -> Any:
    raw = extra.get(name, default)
    if isinstance(raw, bool):
        raise SettingsError(f"kv_connector_extra_config.{name}: expected a number, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise SettingsError(f"kv_connector_extra_config.{name}: expected a number, got {raw!r}") from None


def _cpu_list(extra: dict[str, Any]) -> frozenset[int] | None:
    """kv_cpus: CPU ids like "2,4-7" (Linux's cpu list format), or absent/"auto"."""
    raw = str(extra.get("kv_cpus", "auto")).strip()
    if raw in ("", "auto"):
        return None
    cpus: set[int] = set()
    try:
        for part in raw.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise SettingsError(f"kv_connector_extra_config.kv_cpus: expected CPU ids like '2,4-7', got {raw!r}") from None
    if not cpus or min(cpus) < 0:
        raise SettingsError(f"kv_connector_extra_config.kv_cpus: expected CPU ids like '2,4-7', got {raw!r}")
    return frozenset(cpus)


def _optional(extra: dict[str, Any], name: str) -> str | None:
    value = extra.get(name)
    return None if value in (None, "") else str(value)
