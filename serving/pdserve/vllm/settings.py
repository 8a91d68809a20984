"""The connector's settings: vLLM's `kv_connector_extra_config`, checked once by a pydantic model (the KV channel's
settings, pdserve.kv.settings, plus the connector's own), with errors naming the key.

Pure Python (no vLLM, no torch), so the keys and their defaults can be read and tested without vLLM installed.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator

from pdserve.common.kv_tls import RotatingContext, kv_client_context, kv_server_context
from pdserve.kv.auth import SecretKey
from pdserve.kv.params import derive_params_key
from pdserve.kv.settings import KVChannelSettings

RELEASE_VERSION = r"^[A-Za-z0-9._-]{1,64}$"  # as roles/pdserve and roles/vllm_engine take a version
EXTRA_CONFIG = "kv_connector_extra_config"


class SettingsError(ValueError):
    """A bad kv_connector_extra_config; the message starts with the key."""


def kv_port_of(base: int, *, dp_index: int, tp_size: int, tp_rank: int) -> int:
    """The one rule for where a prefill worker serves its KV shard: `port` (kv_connector_extra_config, the stack's
    KV port) is data-parallel engine 0's tensor-parallel rank 0; engine d's rank r listens on
    base + d * tp_size + r. An instance of TP t x DP d therefore holds the t * d ports [base, base + t * d), and
    kv_transfer_params name the answering engine's rank-0 port (decode rank r pulls from remote_port + r).
    pdstack renders the same range into the security groups (pdstack.contract.components.kv_port_range)."""
    return base + dp_index * tp_size + tp_rank


def kv_ports_used(tp_size: int, dp_size: int) -> int:
    """How many consecutive ports from `port` an instance of TP tp_size x DP dp_size listens on (see kv_port_of)."""
    return tp_size * dp_size


class ConnectorConfig(KVChannelSettings):
    """PdstackConnector's kv_connector_extra_config: the KV channel's settings under pdserve's own names and
    defaults (pdserve.kv.settings), and what only the connector has."""

    kv_key_file: Path = Field(description="the KV channel's shared key (required)")
    advertise_host: str = Field("127.0.0.1", description="where decode pulls this prefill's KV from")
    kv_bytes_per_stream: int = Field(32 << 20, gt=0, description="a pull opens one stream per this many bytes")
    kv_open_wait_seconds: float = Field(
        10.0, ge=0, description="how long a pull of KV prefill has not opened yet waits for it (early dispatch)"
    )
    kv_tls_reload_seconds: float = Field(5.0, gt=0, description="how often a handshake checks for rotated TLS files")
    run_dir: Path = Field(
        default_factory=lambda: Path(tempfile.gettempdir()) / "pdstack-vllm",
        description="where each worker writes its instance.json and results",
    )
    kv_cpus: frozenset[int] | None = Field(
        None, description="CPU ids like '2,4-7' for the connector's threads ('auto': the forward thread's)"
    )
    release_version: str | None = Field(None, pattern=RELEASE_VERSION, description="the release the engine serves")

    @field_validator("kv_cpus", mode="before")
    @classmethod
    def _cpu_list(cls, raw: object) -> frozenset[int] | None:
        """Linux's cpu list format ("2,4-7"), or absent/"auto"."""
        if isinstance(raw, (set, frozenset)):
            return frozenset(raw)
        text = "auto" if raw is None else str(raw).strip()
        if text in ("", "auto"):
            return None
        cpus: set[int] = set()
        try:
            for part in text.split(","):
                low, _, high = part.partition("-")
                cpus.update(range(int(low), int(high or low) + 1))
        except ValueError:
            raise ValueError(f"expected CPU ids like '2,4-7', got {text!r}") from None
        if not cpus or min(cpus) < 0:
            raise ValueError(f"expected CPU ids like '2,4-7', got {text!r}")
        return frozenset(cpus)


class ConnectorSettings(ConnectorConfig):
    """One worker's settings: its kv_connector_extra_config (checked once), the key read from kv_key_file, and where
    vLLM placed it (tensor-parallel rank, data-parallel engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    key: SecretKey
    engine_id: str
    tp_size: int = 1
    data_parallel: bool = False  # one of several DP engines of an instance (see pdserve.vllm.connector)
    dp_index: int = 0  # vLLM's parallel_config.data_parallel_index: which DP engine of the instance this is
    tp_rank: int = 0  # this worker's tensor-parallel rank (0 in the scheduler process)

    @classmethod
    def of(
        cls,
        extra: dict[str, Any],
        *,
        producer: bool,
        engine_id: str,
        tp_size: int = 1,
        dp_index: int = 0,
        data_parallel: bool = False,
    ) -> ConnectorSettings:
        """From kv_connector_extra_config and vLLM's parallel layout; SettingsError naming the first bad key."""
        try:
            config = ConnectorConfig.model_validate(extra)
        except ValidationError as error:
            raise SettingsError(_first_problem(error)) from None
        try:
            key = SecretKey.from_file(config.kv_key_file)
        except ValueError as error:
            raise SettingsError(f"{EXTRA_CONFIG}.kv_key_file: {error}") from None
        if tp_size < 1 or dp_index < 0:
            raise SettingsError(f"parallel_config: tensor_parallel_size {tp_size}, data_parallel_index {dp_index}")
        if producer:
            _check_ports(config.kv_port, tp_size, dp_index)
        return cls(
            **dict(config),
            key=key,
            engine_id=engine_id,
            tp_size=tp_size,
            dp_index=dp_index,
            data_parallel=data_parallel,
        )

    @property
    def port(self) -> int:
        """This worker's KV port (prefill); for rank 0, the one kv_transfer_params name as remote_port."""
        return kv_port_of(self.kv_port, dp_index=self.dp_index, tp_size=self.tp_size, tp_rank=self.tp_rank)

    @property
    def bind_host(self) -> str:
        """Where prefill's KV listener binds: kv_host, else advertise_host (where decode pulls from), not every one."""
        return self.kv_host or self.advertise_host

    @property
    def worker_dir(self) -> Path:
        """This worker's own directory (its port makes it unique per rank and DP engine): results, instance.json."""
        return self.run_dir / f"{self.engine_id}-{self.port}"

    def streams_for(self, pull_bytes: int) -> int:
        """Streams for a pull of `pull_bytes`: one per kv_bytes_per_stream, at most kv_streams. A small pull on one
        stream keeps one congestion window open: split over 4 pooled connections, each stream's window covers a
        quarter of what one warm connection's does, and the last layer's chunk (what decode waits for once prefill
        ends) can wait a round trip for acknowledgements (bench/vllm_ttft, 2 MiB at 512 tokens: 1.07-1.14x the
        bound on 1 stream, 1.10-1.25x on 4)."""
        return max(1, min(self.kv_streams, -(-pull_bytes // self.kv_bytes_per_stream)))

    def for_rank(self, tp_rank: int) -> ConnectorSettings:
        if not 0 <= tp_rank < self.tp_size:
            raise SettingsError(f"tp_rank: {tp_rank} is not a rank of tensor_parallel_size {self.tp_size}")
        return self.model_copy(update={"tp_rank": tp_rank})

    @property
    def params_key(self) -> bytes:
        """Signs (prefill) and verifies (decode) kv_transfer_params; the gateway holds only this derived key."""
        return derive_params_key(self.key.material)

    def server_tls(self) -> RotatingContext | None:
        """TLS for prefill's KV listener; with kv_tls_ca too, clients must present a certificate signed by it."""
        if self.kv_tls_cert is None or self.kv_tls_key is None:
            return None
        return kv_server_context(self.kv_tls_cert, self.kv_tls_key, self.kv_tls_ca, self.kv_tls_reload_seconds)

    def client_tls(self) -> RotatingContext | None:
        """TLS for decode's pulls: the prefill certificate must chain to kv_tls_ca (decode's own cert if given)."""
        if self.kv_tls_ca is None:
            return None
        return kv_client_context(self.kv_tls_ca, self.kv_tls_cert, self.kv_tls_key, self.kv_tls_reload_seconds)


def _check_ports(port: int, tp_size: int, dp_index: int) -> None:
    if not 0 < port < 65536:
        # The scheduler process names the port in kv_transfer_params, but the worker binds it: it must be fixed.
        raise SettingsError(f"{EXTRA_CONFIG}.kv_port: a prefill (kv_producer) needs a fixed port in 1..65535")
    last = kv_port_of(port, dp_index=dp_index, tp_size=tp_size, tp_rank=tp_size - 1)
    if last > 65535:
        raise SettingsError(
            f"{EXTRA_CONFIG}.kv_port: {port}: DP engine {dp_index}'s {tp_size} TP ranks would listen up to {last} "
            "(one port per worker, see kv_port_of), above 65535"
        )


def _first_problem(error: ValidationError) -> str:
    """`kv_connector_extra_config.<key>: <what is wrong>` for the first problem pydantic found."""
    problem = error.errors()[0]
    message = "unknown key" if problem["type"] == "extra_forbidden" else problem["msg"].removeprefix("Value error, ")
    if not problem["loc"]:  # a check across keys: its message names them
        return f"{EXTRA_CONFIG}.{message}"
    key = ".".join(str(part) for part in problem["loc"])
    return f"{EXTRA_CONFIG}.{key}: {message} (given {problem.get('input')!r})"


def release_version(extra: dict[str, Any]) -> str | None:
    """The release the engine serves (`release_version`, set by pdstack's deploy), or None outside a deploy."""
    version = extra.get("release_version")
    if version is not None and not (isinstance(version, str) and re.fullmatch(RELEASE_VERSION, version)):
        raise SettingsError(f"{EXTRA_CONFIG}.release_version: 1-64 of A-Z a-z 0-9 . _ -, got {version!r}")
    return version
