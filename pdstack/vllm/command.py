"""The vLLM engine's and its agent's command lines, rendered once from the stack's `serving` block and the contract.

A prefill or decode node runs two containers of one image (serving/Containerfile.vllm-cpu, .vllm-gpu): vLLM's
OpenAI API server with pdstack's KV connector (or NIXL), and `pdserve agent` beside it, which registers the engine
with the scheduler. Everything either is started with comes from here: the settings from `serving.vllm` and
`serving.limits`/`timeouts`, the ports, listen address and secret files from pdstack.contract.components, and from the
caller only what differs per node (its address, the scheduler's URL, the release, the instance id). Secrets are file
paths or podman secrets exposed as environment variables, never values in an argv.

tests/pdstack/vllm/test_command.py checks what is rendered against the agent's own parser and the connector's own
settings parser; tests/vllm/test_command_line.py parses the engine's argv with vLLM's own argument parser.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.vllm.release import MIDDLEWARE as RELEASE_MIDDLEWARE
from pdstack.contract.components import (
    INSTANCE_TOKEN,
    KV_KEY,
    LISTEN_HOST,
    SERVER_TOKEN,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_DIR,
    TLS_KEY_FILE,
    SecretFile,
    contract,
)
from pdstack.contract.serving_env import kv_channel
from pdstack.model import Engine, KvConnector, PoolRole, Serving, Vllm

VLLM_PYTHON = "/opt/vllm/bin/python"  # both vLLM images' interpreter (Containerfile.vllm-cpu's venv; a link on GPU)
API_SERVER = "vllm.entrypoints.openai.api_server"  # the images' entry point; it takes `vllm serve`'s arguments
AGENT_MODULE = "pdserve.cli"
RUN_DIR = "/run/pdstack-vllm"  # the connector's run_dir: a volume both containers mount (instance.json)
PDSTACK_CONNECTOR = ("PdstackConnector", "pdserve.vllm.connector")
NIXL_CONNECTOR = "NixlConnector"
KV_ROLES = {PoolRole.PREFILL: "kv_producer", PoolRole.DECODE: "kv_consumer"}
ENGINE_SECRET_ENV: Mapping[str, SecretFile] = {"VLLM_API_KEY": SERVER_TOKEN}
"""vLLM takes its API key as a value (`--api-key` or VLLM_API_KEY), not a file: it comes as a podman (or Kubernetes)
secret exposed as this variable, the same stack secret the gateway presents and the agent reads as a file."""


@dataclass(frozen=True)
class KvTls:
    """Files for TLS on the KV channel (connector keys tls_cert/tls_key/tls_ca): prefill serves with cert and key,
    decode verifies with the CA (and presents its own cert when given, for prefill's client check)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None


@dataclass(frozen=True)
class NodeTls(KvTls):
    """TLS of a vLLM node from the node's pair and the CA mounted at the contract's TLS_DIR (as pdserve's): the API
    server serves with them (re-read as they change) and, under the stack's mutual TLS, requires a client
    certificate from the CA; the connector's KV channel uses the same files; the agent reaches the engine and the
    scheduler over https, verifying the CA and presenting the pair."""

    cert: str | None = f"{TLS_DIR}/{TLS_CERT_FILE}"
    key: str | None = f"{TLS_DIR}/{TLS_KEY_FILE}"
    ca: str | None = f"{TLS_DIR}/{TLS_CA_FILE}"
    mutual: bool = False

    def server_flags(self) -> list[str]:
        """vLLM's API server (uvicorn): ssl_cert_reqs 2 is ssl.CERT_REQUIRED."""
        flags = [
            "--ssl-certfile",
            str(self.cert),
            "--ssl-keyfile",
            str(self.key),
            "--ssl-ca-certs",
            str(self.ca),
            "--enable-ssl-refresh",
        ]
        return [*flags, "--ssl-cert-reqs", "2"] if self.mutual else flags

    def client_flags(self) -> list[str]:
        """pdserve agent's (pdserve.common.tls TLSClientSettings)."""
        return ["--tls-ca", str(self.ca), "--tls-client-cert", str(self.cert), "--tls-client-key", str(self.key)]


def _vllm(serving: Serving) -> Vllm:
    if serving.engine is not Engine.VLLM or serving.vllm is None:
        raise ValueError(f"serving.engine: the vLLM command line needs engine vllm, got {serving.engine}")
    return serving.vllm


def _vllm_of(serving: Serving, side: PoolRole) -> Vllm:
    if side not in KV_ROLES:
        raise ValueError(f"side: a vLLM engine is prefill or decode, got {side}")
    return _vllm(serving)


def http_port(serving: Serving, side: PoolRole) -> int:
    """vLLM's API port on a node of `side`: the port the contract gives that side's server."""
    return contract(serving)[str(side)].port


def kv_port(serving: Serving) -> int:
    port = contract(serving)["prefill"].kv_port
    assert port is not None  # the contract gives prefill its KV port
    return port


def kv_transfer_config(
    serving: Serving, side: PoolRole, advertise_host: str, tls: KvTls | None = None, version: str | None = None
) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for `side` (`version`: the release the engine serves, see connector_extra_config)."""
    v = _vllm_of(serving, side)
    common = {"kv_role": KV_ROLES[side], "kv_load_failure_policy": serving.kv_load_failure_policy}
    if v.kv_connector is KvConnector.NIXL:
        # NIXL's lease is whole seconds (nixl/base_scheduler.py); its side channel is set by environment (engine_env)
        extra: dict[str, Any] = {"kv_lease_duration": math.ceil(serving.timeouts.kv_lease_s)}
        return {"kv_connector": NIXL_CONNECTOR, **common, "kv_connector_extra_config": extra}
    name, module = PDSTACK_CONNECTOR
    extra = connector_extra_config(serving, side, advertise_host, tls, version)
    return {"kv_connector": name, "kv_connector_module_path": module, **common, "kv_connector_extra_config": extra}


def connector_extra_config(
    serving: Serving, side: PoolRole, advertise_host: str, tls: KvTls | None = None, version: str | None = None
) -> dict[str, Any]:
    """PdstackConnector's kv_connector_extra_config (pdserve.vllm.settings.ConnectorConfig): the stack's KV channel
    settings under the names and with the values pdserve's servers get (pdstack.contract.serving_env.kv_channel), on
    both sides; prefill also advertises where decode pulls from (its listener binds there, not every address of the
    node). With `version`, the engine's /metrics carries pdserve_build_info{version} as a pdserve server's does, so
    the canary judge attributes its KV load failures to its release."""
    extra: dict[str, Any] = {
        "kv_key_file": KV_KEY.path,
        "run_dir": RUN_DIR,
        **kv_channel(serving).model_dump(mode="json", exclude_unset=True),
    }
    if side is PoolRole.PREFILL:
        extra["advertise_host"] = advertise_host
    if tls is not None:
        files = {"kv_tls_cert": tls.cert, "kv_tls_key": tls.key, "kv_tls_ca": tls.ca}
        extra |= {name: path for name, path in files.items() if path is not None}
    if version is not None:
        extra["release_version"] = version
    return extra


def max_num_seqs(serving: Serving) -> int:
    """vLLM's --max-num-seqs: `extra_args` when it sets it, else `serving.limits.max_batch_size`."""
    value = _vllm(serving).extra_args.get("max-num-seqs", serving.limits.max_batch_size)
    assert isinstance(value, int)  # the model checks each extra flag's type
    return value


def _extra_flags(serving: Serving) -> list[str]:
    v, limits = _vllm(serving), serving.limits
    defaults: dict[str, bool | int | str] = {
        "max-num-seqs": limits.max_batch_size,
        "max-num-batched-tokens": limits.prefill_token_budget,
    }
    out: list[str] = []
    for flag, value in (defaults | v.extra_args).items():
        if isinstance(value, bool):  # vLLM's boolean flags are BooleanOptionalAction: --x / --no-x
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out


def engine_args(
    serving: Serving, side: PoolRole, advertise_host: str, tls: KvTls | None = None, version: str | None = None
) -> tuple[str, ...]:
    """What follows the image's entry point (the API server module): `vllm serve`'s arguments for `side`, serving
    release `version` when given."""
    v = _vllm_of(serving, side)
    role = v.role(side)
    args = [
        "--model",
        serving.model.path,
        "--served-model-name",
        serving.model.name,
        "--host",
        LISTEN_HOST,
        "--port",
        str(http_port(serving, side)),
        "--dtype",
        str(v.setting(side, "dtype")[0]),
        "--kv-cache-dtype",
        v.kv_cache_dtype,
        "--max-model-len",
        str(v.max_model_len),
        "--block-size",
        str(v.setting(side, "block_size")[0]),
        "--gpu-memory-utilization",
        str(v.setting(side, "gpu_memory_utilization")[0]),
        "--tensor-parallel-size",
        str(role.tensor_parallel_size),
        "--data-parallel-size",
        str(role.data_parallel_size),
    ]
    if role.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    if role.enable_eplb:
        args.append("--enable-eplb")
    if role.num_redundant_experts:
        args += ["--eplb-config", json.dumps({"num_redundant_experts": role.num_redundant_experts})]
    args += _extra_flags(serving)
    if serving.tracing is not None:  # vLLM continues the gateway's trace (engine_env says how it exports)
        args += ["--otlp-traces-endpoint", serving.tracing.otlp_endpoint]
    config = kv_transfer_config(serving, side, advertise_host, tls, version)
    args += ["--kv-transfer-config", json.dumps(config, sort_keys=True, separators=(",", ":"))]
    if side is PoolRole.PREFILL and v.kv_connector is KvConnector.PDSTACK:  # the gateway frees unused KV through it
        args += ["--middleware", RELEASE_MIDDLEWARE]
    if isinstance(tls, NodeTls):
        args += tls.server_flags()
    return tuple(args)


def engine_command(serving: Serving, side: PoolRole, advertise_host: str, tls: KvTls | None = None) -> tuple[str, ...]:
    return (VLLM_PYTHON, "-m", API_SERVER, *engine_args(serving, side, advertise_host, tls))


def engine_env(serving: Serving, side: PoolRole, advertise_host: str) -> dict[str, str]:
    """Plain environment the engine needs besides its image's own (ENGINE_SECRET_ENV comes as secrets): NIXL's
    side channel, where decode reaches prefill's handshake listener (the contract's KV port); with tracing, how
    vLLM's OpenTelemetry exporter sends (OTLP/HTTP like pdserve's, vLLM's default is gRPC) and samples (the
    gateway's decision, else the stack's ratio)."""
    v = _vllm_of(serving, side)
    env: dict[str, str] = {}
    if v.kv_connector is KvConnector.NIXL:
        env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": advertise_host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv_port(serving))}
    if serving.tracing is not None:
        env |= {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": f"vllm-{side}",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(serving.tracing.sample_ratio),
        }
    return env


def agent_args(
    serving: Serving,
    side: PoolRole,
    *,
    advertise_host: str,
    scheduler_url: str,
    version: str,
    instance_id: str,
    tls: NodeTls | None = None,
) -> tuple[str, ...]:
    """`pdserve agent`'s arguments (pdserve/agent/settings.py) for the engine on this node: it reaches vLLM on
    loopback (over TLS by the node's name, which its certificate carries), registers it under that name with the
    token derived for `instance_id`."""
    v = _vllm_of(serving, side)
    if v.kv_connector is KvConnector.NIXL:
        raise ValueError(
            "serving.vllm.kv_connector: pdserve agent registers an engine from PdstackConnector's instance.json "
            "(its KV fingerprint and endpoint); with nixl there is none to register yet"
        )
    port = http_port(serving, side)
    engine_url = f"https://{advertise_host}:{port}" if tls else f"http://127.0.0.1:{port}"
    return (
        "agent",
        "--engine-url",
        engine_url,
        "--role",
        str(side),
        "--scheduler-url",
        scheduler_url,
        "--scheduler-token-file",
        INSTANCE_TOKEN.path,
        "--advertise-url",
        f"{'https' if tls else 'http'}://{advertise_host}:{port}",
        "--version",
        version,
        "--connector-run-dir",
        RUN_DIR,
        "--instance-id",
        instance_id,
        "--engine-token-file",
        SERVER_TOKEN.path,
        "--max-num-seqs",
        str(max_num_seqs(serving)),
        *(tls.client_flags() if tls else []),
    )


def agent_command(serving: Serving, side: PoolRole, **node: Any) -> tuple[str, ...]:
    """The agent's whole argv: the image's interpreter running pdserve's CLI with agent_args(serving, side, **node)."""
    return (VLLM_PYTHON, "-m", AGENT_MODULE, *agent_args(serving, side, **node))


def secret_files(side: PoolRole) -> tuple[SecretFile, ...]:
    """The files the two containers read: the KV key (engine), the instance token and server token (agent)."""
    return (KV_KEY, INSTANCE_TOKEN, SERVER_TOKEN) if side in KV_ROLES else ()
