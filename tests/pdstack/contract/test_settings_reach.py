"""Every serving setting of the stack reaches a component, and every field of every settings model pdstack renders
for (pdserve's gateway, scheduler, servers, agent and tracing, vLLM's PdstackConnector) is set from the stack, a
secret file, a TLS file, set per node, or named here as pdserve's default with the reason: changing a stack value
changes what pdstack renders for pdserve's components (the contract) or for vLLM (both sides' command lines), and
no component reads a setting nobody decided on."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, get_args

import pytest
from pydantic import BaseModel

from pdserve.agent.settings import AgentSettings
from pdserve.common.settings import env_name
from pdserve.common.tls import TLSClientSettings
from pdserve.common.tracing import TracingSettings
from pdserve.gateway.settings import GatewaySettings
from pdserve.kv.admission import KVListenerSettings
from pdserve.kv.settings import KVChannelSettings
from pdserve.scheduler.settings import SchedulerSettings
from pdserve.server.settings import ServerSettings
from pdserve.vllm.settings import ConnectorConfig
from pdstack.contract.components import SECRET_FILES, TLS_DIR, Component, contract
from pdstack.contract.serving_env import tracing_settings
from pdstack.model import Engine, Model, PoolRole, Serving, Tracing, Vllm
from pdstack.stacks.component_settings import NODE_SETTINGS
from pdstack.vllm.command import engine_args, engine_env
from pdstack.vllm.deploy import PLACEHOLDERS, side_vars

PDSERVE = Serving(model=Model(name="tiny", path="/var/lib/pdstack/models/tiny"))
VLLM = PDSERVE.model_copy(
    update={
        "engine": Engine.VLLM,
        "vllm": Vllm(
            image="localhost/pdstack-vllm-cpu:v0.32.0@sha256:" + "ab" * 32,
            version="0.32.0",
            dtype="float32",
            max_model_len=12288,
            block_size=32,
        ),
    }
)
SECTIONS = ("ports", "limits", "timeouts")
NOT_KNOBS = {"model", "engine", "vllm", "tracing"}  # sections of their own, checked where they are rendered


def rendered(serving: Serving) -> str:
    """What pdstack renders from `serving` for every component it runs (vLLM's too when it is the engine)."""
    parts: list[Any] = [repr(contract(serving))]
    if serving.engine is Engine.VLLM:
        for side in (PoolRole.PREFILL, PoolRole.DECODE):
            parts += [engine_args(serving, side, "10.0.0.7"), engine_env(serving, side, "10.0.0.7")]
    return json.dumps(parts, default=str)


def changed(value: Any, annotation: Any) -> Any:
    """Another valid value of a field."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5
    return next(choice for choice in get_args(annotation) if choice != value)


def knobs() -> list[tuple[str | None, str]]:
    """(section, field) of every scalar serving setting."""
    top = [(None, name) for name in Serving.model_fields if name not in NOT_KNOBS and name not in SECTIONS]
    nested = [(section, name) for section in SECTIONS for name in type(getattr(PDSERVE, section)).model_fields]
    return top + nested


def with_knob(serving: Serving, section: str | None, name: str) -> Serving:
    owner: BaseModel = serving if section is None else getattr(serving, section)
    value = changed(getattr(owner, name), type(owner).model_fields[name].annotation)
    if section is None:
        return serving.model_copy(update={name: value})
    return serving.model_copy(update={section: owner.model_copy(update={name: value})})


@pytest.mark.parametrize(("section", "name"), knobs(), ids=[f"{s or 'serving'}.{n}" for s, n in knobs()])
def test_every_stack_setting_reaches_a_component(section: str | None, name: str) -> None:
    reached = [
        serving.engine
        for serving in (PDSERVE, VLLM)
        if rendered(with_knob(serving, section, name)) != rendered(serving)
    ]
    assert reached, f"pdstack:serving.{f'{section}.' if section else ''}{name} changes nothing either engine runs with"


# -- every field of every settings model pdstack renders for is classified once ---------------------------------
# A field is set from the stack when pdstack's rendering holds it (the contract's PDSERVE_* settings and TLS settings,
# vLLM's side of pdstack.vllm.deploy), a secret when its rendered value is a secret file's path (SECRET_FILES), a TLS
# file when its value is a file under TLS_DIR, and set per node when its value holds what the role fills in per node
# (pdstack.vllm.deploy.PLACEHOLDERS). The rest is named below, each with where or why, under the class declaring it.
TRACED = Tracing(otlp_endpoint="http://collector:4318/v1/traces")
EVERY_KNOB = {"tracing": TRACED, "allow_plaintext": True, "mutual_tls": True}
STACKS = (PDSERVE.model_copy(update=EVERY_KNOB), VLLM.model_copy(update=EVERY_KNOB))
SECRET_PATHS = frozenset(s.path for files in SECRET_FILES.values() for s in files)

SET_PER_NODE: dict[type[BaseModel], dict[str, str]] = {
    GatewaySettings: {
        "scheduler_url": "roles/pdserve pdserve__env_node; in the cloud infra/workloads (the scheduler's Service)",
        "rate_limit_storage": "roles/pdserve pdserve__env_node; in the cloud infra/workloads (the in-cluster store)",
    },
    ServerSettings: {
        "role": "the command line, `pdserve ROLE` (ComponentContract.args)",
        "model": "roles/pdserve pdserve__env_server: pdserve_model_dir mounted at /model",
        "advertise_host": "roles/pdserve pdserve__env_server: the node's address",
        "engine_id": "roles/pdserve pdserve__env_server: worked out with the release (serving_node_engine_id)",
        "version": "roles/pdserve pdserve__env_server: the release's version",
        "scheduler_url": "roles/pdserve pdserve__env_server: the scheduler's URL where the node is",
        "heartbeat_seconds": "roles/pdserve pdserve__env_server (pdserve_heartbeat_seconds)",
    },
}
PDSERVE_DEFAULT: dict[type[BaseModel], dict[str, str]] = {
    TLSClientSettings: {
        "tls_reload_seconds": "how often rotated certificate files are looked for: no deployment choice"
    },
    KVListenerSettings: {
        "kv_handshake_timeout_seconds": "the listener's admission limits keep pdserve's defaults (docs/serving.md)",
        "kv_max_handshakes": "the listener's admission limits keep pdserve's defaults (docs/serving.md)",
        "kv_max_handshakes_per_address": "the listener's admission limits keep pdserve's defaults (docs/serving.md)",
        "kv_max_connections": "the listener's admission limits keep pdserve's defaults (docs/serving.md)",
        "kv_drop_log_seconds": "how often drops are logged: an operational detail, not a stack choice",
    },
    KVChannelSettings: {
        "kv_host": "prefill's KV listener binds the advertised address, which the node gives",
        "kv_store_bytes": "the KV held under lease is bounded by pdserve's memory default; the stack sizes no memory",
        "kv_tls_server_name": "decode verifies prefill's certificate for the host it pulls from (remote_host)",
    },
    GatewaySettings: {
        "routing_poll_interval": "how often the routing table is read: pdserve's timing, not a stack choice",
        "tokenizer_file": "the gateway runs where the model is not; it estimates tokens from bytes",
        "max_body_bytes": "bounded before parsing by pdserve; the stack limits tokens, not bytes",
        "default_max_tokens": "what a request without max_tokens gets; the stack caps it (limits.max_output_tokens)",
        "requests_per_second": "per-tenant rate: the keys file sets it per tenant, pdserve's default otherwise",
        "request_burst": "per-tenant burst: the keys file sets it per tenant, pdserve's default otherwise",
        "tokens_per_minute": "per-tenant token budget: the keys file sets it per tenant, pdserve's default otherwise",
        "tenant_max_concurrent_requests": "the keys file sets it per tenant, pdserve's default otherwise",
        "inter_token_timeout": "the stack times the first token and the request, not the gaps between tokens",
        "kv_params_key_file": "early dispatch is off in deployments: the gateway is handed no KV-derived key",
        "max_connections": "the upstream pool's size: pdserve's default",
        "log_level": "info everywhere; debugging changes it by hand",
        "log_prompts": "debugging only, never in a deployment",
    },
    SchedulerSettings: {
        "heartbeat_interval": "the scheduler's timing of instances: pdserve's default",
        "missed_heartbeats": "the scheduler's timing of instances: pdserve's default",
        "forget_dead_after": "the scheduler's timing of instances: pdserve's default",
        "target_utilisation": "the P:D advice's target: pdserve's default (the autoscaler has its own)",
        "scale_up_utilisation": "the P:D advice's threshold: pdserve's default",
        "scale_down_utilisation": "the P:D advice's threshold: pdserve's default",
        "max_body_bytes": "bounded before parsing by pdserve: no stack choice",
        "log_level": "info everywhere; debugging changes it by hand",
        # Nodes joining with their instance role (pdserve.scheduler.join): off until the control plane renders the
        # node roles' ARNs, the audience and the region (#35)
        "join_node_roles": "join is off until the control plane renders its node roles",
        "join_audience": "join is off until the control plane renders its node roles",
        "join_region": "join is off until the control plane renders its node roles",
        "join_sts_url": "join is off until the control plane renders its node roles",
        "join_sts_timeout": "the bound on STS's answer: pdserve's default",
        "join_max_concurrent": "the bound on joins at once: pdserve's default",
    },
    ServerSettings: {
        "max_body_bytes": "bounded before parsing by pdserve; the gateway's limit plus room",
        "kv_memory_bytes": "the reference engine's KV memory: pdserve's default (vLLM sizes its own)",
        "max_model_len": "the reference engine takes the model's context (serving.vllm.max_model_len is vLLM's)",
        "blas_threads": "the reference engine's BLAS threads: pdserve's default",
        "log_level": "info everywhere; debugging changes it by hand",
        "fault_error_rate": "fault injection, for tests only",
        "fault_delay_ms": "fault injection, for tests only",
        "fault_perturb_output": "fault injection, for tests only",
    },
    AgentSettings: {
        "otlp_traces_endpoint": "the agent answers no request, so its calls (registration, heartbeats) start no trace",
        "trace_sample_ratio": "the agent answers no request, so its calls start no trace",
        "trace_prompts": "the agent sees no prompt",
        "heartbeat_seconds": "the agent's heartbeat: pdserve's default",
        "engine_timeout_seconds": "the agent's calls to vLLM on loopback: pdserve's default",
        "drain_grace_seconds": "the agent's drain timing: pdserve's default (roles/vllm_engine bounds its stop)",
        "drain_timeout_seconds": "the agent's drain timing: pdserve's default (roles/vllm_engine bounds its stop)",
        "log_level": "info everywhere; debugging changes it by hand",
    },
    ConnectorConfig: {
        "kv_bytes_per_stream": "how a pull splits over streams: the connector's tuning (bench/vllm_ttft)",
        "kv_open_wait_seconds": "early dispatch's wait: the connector's default",
        "kv_tls_reload_seconds": "how often rotated KV certificate files are looked for: no deployment choice",
        "kv_cpus": "the connector's threads follow the forward thread's CPUs ('auto')",
    },
}
HAND_CLASSIFIED = {"node": SET_PER_NODE, "default": PDSERVE_DEFAULT}


def as_fields(model: type[BaseModel], env: Mapping[str, str]) -> dict[str, str]:
    """Rendered PDSERVE_* variables by field name of `model` (pdserve's own naming, env_name); one it lacks fails."""
    by_name = {env_name(name): name for name in model.model_fields}
    assert set(env) <= set(by_name), f"{model.__name__} has no field for {sorted(set(env) - set(by_name))}"
    return {by_name[name]: value for name, value in env.items()}


def contract_fields(model: type[BaseModel], *components: Component) -> dict[str, str]:
    """What the contract renders for `components` (settings, secret files, TLS settings), by field name."""
    rendered: dict[str, str] = {}
    for serving in STACKS:
        for component in components:
            settings = contract(serving)[component]
            rendered |= as_fields(model, {**settings.env(), **settings.tls_env()})
    return rendered


def tracing_fields() -> dict[str, str]:
    return as_fields(TracingSettings, tracing_settings(STACKS[0]))


def vllm_containers() -> list[dict[str, Any]]:
    """Both sides' engine and agent as pdstack.vllm.deploy renders them, without and with the node's TLS."""
    sides = [side_vars(STACKS[1], side) for side in (PoolRole.PREFILL, PoolRole.DECODE)]
    return [variant[name] for side in sides for variant in (side, side["tls"]) for name in ("engine", "agent")]


def agent_fields() -> dict[str, str]:
    """The agent's flags (after `agent`) by field name."""
    rendered: dict[str, str] = {}
    for container in vllm_containers():
        command = container["command"]
        if "agent" in command:
            flags = command[command.index("agent") + 1 :]
            rendered |= {
                flag.removeprefix("--").replace("-", "_"): value
                for flag, value in zip(flags[::2], flags[1::2], strict=True)
            }
    assert set(rendered) <= set(AgentSettings.model_fields), sorted(set(rendered) - set(AgentSettings.model_fields))
    return rendered


def connector_fields() -> dict[str, str]:
    """PdstackConnector's kv_connector_extra_config keys, as strings."""
    rendered: dict[str, str] = {}
    for container in vllm_containers():
        command = container["command"]
        if "--kv-transfer-config" in command:
            config = json.loads(command[command.index("--kv-transfer-config") + 1])
            rendered |= {key: str(value) for key, value in config["kv_connector_extra_config"].items()}
    assert set(rendered) <= set(ConnectorConfig.model_fields), sorted(set(rendered) - set(ConnectorConfig.model_fields))
    return rendered


CONSUMERS: dict[str, tuple[type[BaseModel], Callable[[], dict[str, str]]]] = {
    "gateway": (GatewaySettings, lambda: contract_fields(GatewaySettings, Component.GATEWAY)),
    "scheduler": (SchedulerSettings, lambda: contract_fields(SchedulerSettings, Component.SCHEDULER)),
    "server": (
        ServerSettings,
        lambda: contract_fields(ServerSettings, Component.PREFILL, Component.DECODE, Component.COLOCATED),
    ),
    "tracing": (TracingSettings, tracing_fields),
    "agent": (AgentSettings, agent_fields),
    "connector": (ConnectorConfig, connector_fields),
}


def rendered_kind(value: str) -> str:
    if value in SECRET_PATHS:
        return "secret"
    if value.startswith(f"{TLS_DIR}/"):
        return "tls"
    if any(placeholder in value for placeholder in PLACEHOLDERS):
        return "node"
    return "stack"


def classification(model: type[BaseModel], rendered: Mapping[str, str]) -> dict[str, list[str]]:
    """Every field of `model` with each way it is classified: by what is rendered, and by the tables above (under
    any class it inherits the field from)."""
    return {
        name: ([rendered_kind(rendered[name])] if name in rendered else [])
        + [kind for kind, table in HAND_CLASSIFIED.items() for cls in model.__mro__ if name in table.get(cls, {})]
        for name in model.model_fields
    }


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_every_field_is_classified_once(consumer: str) -> None:
    model, render = CONSUMERS[consumer]
    kinds = classification(model, render())
    assert {name: found for name, found in kinds.items() if len(found) != 1} == {}


def test_every_hand_classified_name_is_a_field_of_a_consumer() -> None:
    consumers = [model for model, _ in CONSUMERS.values()]
    for table in HAND_CLASSIFIED.values():
        for cls, fields in table.items():
            assert any(issubclass(model, cls) for model in consumers), f"{cls.__name__} is no consumer's"
            assert set(fields) <= set(cls.model_fields), (
                f"{cls.__name__} has no {sorted(set(fields) - set(cls.model_fields))}"
            )


def test_validate_stands_in_for_what_each_node_sets() -> None:
    """`pdstack validate` loads each component with stand-ins for what its node sets (NODE_SETTINGS): the same
    fields as classified here (a server's role comes from its command line)."""
    assert set(NODE_SETTINGS[Component.GATEWAY]) == set(SET_PER_NODE[GatewaySettings])
    assert set(NODE_SETTINGS[Component.PREFILL]) == set(SET_PER_NODE[ServerSettings]) - {"role"}
