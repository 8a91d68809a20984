"""What PdstackConnector's worker says about its instance: KV fingerprint, KV endpoint, streaming.

The worker writes `instance.json` atomically once its KV caches are registered, in its own directory under the
connector's run_dir (`<run_dir>/<engine id>-<port>/`, or `<run_dir>` itself):

    {"role": "kv_producer" | "kv_consumer", "fingerprint": "sha256:...", "fingerprint_fields": {...},
     "connector_version": "1", "kv_streaming": true, "kv_host": "10.0.1.5" | null, "kv_port": 14600 | null}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTANCE_FILE = "instance.json"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1}


class InstanceFileError(RuntimeError):
    """The connector's instance file is missing or malformed; the message names the file."""


@dataclass(frozen=True)
class ConnectorInstance:
    path: Path
    fingerprint: str
    fields: dict[str, Any] = field(default_factory=dict)
    kv_host: str | None = None
    kv_port: int | None = None
    kv_streaming: bool = False

    def block_bytes(self) -> int | None:
        """Bytes of one KV block over all layers, from the fingerprint fields; None when they do not say."""
        shape, layers = self.fields.get("block_shape"), self.fields.get("num_layers")
        dtype = str(self.fields.get("kv_dtype", "")).split("/")[0].removeprefix("torch.")
        size = DTYPE_BYTES.get(dtype)
        if not isinstance(shape, list) or not isinstance(layers, int) or size is None:
            return None
        return math.prod(int(d) for d in shape) * layers * size


def find(run_dir: Path, role: str) -> ConnectorInstance:
    """The instance file of this role's worker under `run_dir`; InstanceFileError naming what was looked for."""
    kv_role = KV_ROLES[role]
    candidates = [run_dir / INSTANCE_FILE, *run_dir.glob(f"*/{INSTANCE_FILE}")]
    matching = [path for path in candidates if _role_of(path) == kv_role]
    if matching:
        return read(max(matching, key=_mtime))
    raise InstanceFileError(
        f"connector_run_dir {run_dir}: no {INSTANCE_FILE} of a {kv_role} in it or its subfolders (PdstackConnector's "
        f"worker writes {run_dir}/<engine id>-<port>/{INSTANCE_FILE} once its KV caches are registered; is "
        f"kv_connector_extra_config.run_dir {run_dir}?)"
    )


def read(path: Path) -> ConnectorInstance:
    body = _load(path)
    fingerprint = body.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise InstanceFileError(f"{path}: fingerprint: missing or not a string")
    port = body.get("kv_port")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise InstanceFileError(f"{path}: kv_port: must be a port number or null, got {port!r}")
    host = body.get("kv_host")
    if host is not None and not isinstance(host, str):
        raise InstanceFileError(f"{path}: kv_host: must be a string or null, got {host!r}")
    fields = body.get("fingerprint_fields")
    return ConnectorInstance(
        path,
        fingerprint,
        fields if isinstance(fields, dict) else {},
        host or None,
        port,
        body.get("kv_streaming") is True,
    )


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed since it was listed
        return -1.0


def _role_of(path: Path) -> str | None:
    try:
        role = _load(path).get("role")
    except InstanceFileError:
        return None
    return role if isinstance(role, str) else None


def _load(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text())
    except OSError as exc:
        raise InstanceFileError(f"{path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise InstanceFileError(f"{path}: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InstanceFileError(f"{path}: must hold a JSON object")
    return body
