"""The vLLM engine's and agent's command lines (pdstack/vllm/command.py) are what their consumers accept and mean
the stack's settings: the connector's own settings parser takes the rendered kv_connector_extra_config, the agent's
own parser takes the rendered agent argv, and both agree with the engine's argv on port, run dir and slots.
vLLM's own argument parser is checked in tests/vllm/test_command_line.py (it needs vLLM's environment)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve import cli
from pdserve.agent.settings import AgentSettings
from pdserve.common.settings import load_settings
from pdserve.kv.settings import KVChannelSettings
from pdserve.server.settings import settings_from_args
from pdserve.vllm.settings import ConnectorSettings, SettingsError, release_version
from pdstack.contract.components import (
    INSTANCE_TOKEN,
    KV_KEY,
    LISTEN_HOST,
    SERVER_TOKEN,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_DIR,
    TLS_KEY_FILE,
    contract,
    kv_port_range,
)
from pdstack.contract.files import environment_serving
from pdstack.model import Engine, KvConnector, Model, PoolRole, Serving, Vllm
from pdstack.vllm.command import (
    API_SERVER,
    PDSTACK_CONNECTOR,
    RUN_DIR,
    VLLM_PYTHON,
    KvTls,
    NodeTls,
    agent_args,
    agent_command,
    engine_args,
    engine_command,
    engine_env,
)
from tests.support import STACKS

SIDES = (PoolRole.PREFILL, PoolRole.DECODE)
CLOUD = ("dev", "staging", "prod")
HOST = "10.20.1.7"
DIGEST = "sha256:" + "ab" * 32
CPU = Serving(
    model=Model(name="tiny", path="/var/lib/pdstack/models/tiny"),
    engine=Engine.VLLM,
    vllm=Vllm(
        image=f"localhost/pdstack-vllm-cpu:v0.32.0@{DIGEST}",
        version="0.32.0",
        dtype="float32",
        max_model_len=12288,
        block_size=32,
        extra_args={"enforce-eager": True, "enable-prefix-caching": False},
    ),
    kv_streams=3,
    kv_load_failure_policy="fail",
)


def flags(argv: tuple[str, ...]) -> dict[str, str | None]:
    """--flag value pairs of an argv (a flag followed by another flag has no value)."""
    out: dict[str, str | None] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else None
            out[word] = None if following is None or following.startswith("--") else following
    return out


def kv_config(serving: Serving, side: PoolRole, tls: KvTls | None = None) -> dict[str, Any]:
    """The rendered --kv-transfer-config, decoded."""
    return json.loads(flags(engine_args(serving, side, HOST, tls))["--kv-transfer-config"] or "")


def servings() -> list[tuple[str, Serving]]:
    return [(env, environment_serving(STACKS, env)) for env in CLOUD] + [("cpu", CPU)]


def connector_settings(serving: Serving, side: PoolRole, key_file: Path) -> ConnectorSettings:
    """The connector's settings as its worker would build them from the rendered --kv-transfer-config, with the
    KV key file (a mount on the node) replaced by a local one holding a key."""
    config = kv_config(serving, side)
    extra = dict(config["kv_connector_extra_config"])
    assert extra["kv_key_file"] == KV_KEY.path
    extra["kv_key_file"] = str(key_file)
    return ConnectorSettings.of(extra, producer=side is PoolRole.PREFILL, engine_id="engine")


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    """A key whose bytes the test knows (not tests/support's random kv_key_file): the connector must read exactly
    these."""
    path = tmp_path / "kv.key"
    path.write_bytes(b"k" * 32)
    return path


# Every KV channel knob of the stack, each away from its default, so that a value left at a default shows.
KV_KNOBS = CPU.model_copy(
    update={
        "ports": CPU.ports.model_copy(update={"kv": 9400}),
        "kv_streams": 7,
        "timeouts": CPU.timeouts.model_copy(
            update={"connect_s": 3.5, "kv_read_s": 11.5, "kv_transfer_s": 99.0, "kv_lease_s": 44.0}
        ),
    }
)


@pytest.mark.parametrize(("name", "serving"), [*servings(), ("knobs", KV_KNOBS)], ids=[*CLOUD, "cpu", "knobs"])
@pytest.mark.parametrize("side", SIDES)
def test_both_engines_get_the_stacks_kv_channel_settings_alike(
    name: str, serving: Serving, side: PoolRole, key_file: Path
) -> None:
    """The connector (from the rendered --kv-transfer-config) and a pdserve server of the same side (from the
    contract's PDSERVE_* variables) hold the same value for every KV channel setting: the stack's where it sets one,
    pdserve's default otherwise."""
    config = kv_config(serving, side)
    assert (config["kv_connector"], config["kv_connector_module_path"]) == PDSTACK_CONNECTOR
    assert config["kv_role"] == ("kv_producer" if side is PoolRole.PREFILL else "kv_consumer")
    assert config["kv_load_failure_policy"] == serving.kv_load_failure_policy
    connector = connector_settings(serving, side, key_file)
    assert connector.key.material == b"k" * 32
    assert connector.worker_dir.parent == Path(RUN_DIR)
    node = {"PDSERVE_MODEL": "/model", "PDSERVE_ADVERTISE_HOST": HOST}
    server = settings_from_args(str(side), [], environ={**contract(serving)[str(side)].env(), **node})
    for field in set(KVChannelSettings.model_fields) - {"kv_key_file"}:
        assert getattr(connector, field) == getattr(server, field), field
    timeouts = serving.timeouts
    stack = (
        serving.ports.kv,
        serving.kv_streams,
        timeouts.kv_lease_s,
        timeouts.connect_s,
        timeouts.kv_read_s,
        timeouts.kv_transfer_s,
    )
    assert (
        connector.kv_port,
        connector.kv_streams,
        connector.kv_lease_seconds,
        connector.kv_connect_timeout_seconds,
        connector.kv_read_timeout_seconds,
        connector.kv_transfer_timeout_seconds,
    ) == stack
    if side is PoolRole.PREFILL:
        assert (connector.advertise_host, connector.bind_host) == (HOST, HOST)  # the node's address, not every one
        assert connector.port == contract(serving)["prefill"].kv_port == serving.ports.kv


@pytest.mark.parametrize("side", [PoolRole.PREFILL, PoolRole.DECODE])
def test_the_release_reaches_the_connector_for_its_build_info(side: PoolRole) -> None:
    """What the engine's pdserve_build_info{version} (pdserve/vllm/stats.py) reads, so the canary judge can
    attribute its KV load failures to a release; an engine started outside a deploy names none."""
    argv = engine_args(CPU, side, HOST, version="r4")
    assert release_version(json.loads(flags(argv)["--kv-transfer-config"] or "")["kv_connector_extra_config"]) == "r4"
    assert release_version(kv_config(CPU, side)["kv_connector_extra_config"]) is None


def test_tls_files_reach_the_connector_and_a_half_pair_is_refused_by_it(key_file: Path) -> None:
    tls = KvTls(cert="/run/secrets/kv-tls.crt", key="/run/secrets/kv-tls.key", ca="/run/secrets/kv-ca.crt")
    config = kv_config(CPU, PoolRole.PREFILL, tls)
    extra = config["kv_connector_extra_config"] | {"kv_key_file": str(key_file)}
    settings = ConnectorSettings.of(extra, producer=True, engine_id="e")
    assert (settings.kv_tls_cert, settings.kv_tls_key, settings.kv_tls_ca) == tuple(
        map(Path, (tls.cert, tls.key, tls.ca))
    )
    half = kv_config(CPU, PoolRole.PREFILL, KvTls(cert=tls.cert))["kv_connector_extra_config"]
    with pytest.raises(SettingsError, match="kv_tls_cert"):
        ConnectorSettings.of(half | {"kv_key_file": str(key_file)}, producer=True, engine_id="e")


@pytest.mark.parametrize(("name", "serving"), servings(), ids=[name for name, _ in servings()])
@pytest.mark.parametrize("side", SIDES)
def test_the_engine_argv_carries_the_sides_settings(name: str, serving: Serving, side: PoolRole) -> None:
    v = serving.vllm
    assert v is not None
    role, argv = v.role(side), engine_command(serving, side, HOST)
    assert argv[:3] == (VLLM_PYTHON, "-m", API_SERVER)
    got = flags(argv)
    assert got["--model"] == serving.model.path and got["--served-model-name"] == serving.model.name
    assert got["--port"] == str(contract(serving)[str(side)].port)
    assert got["--host"] == LISTEN_HOST
    assert got["--dtype"] == v.setting(side, "dtype")[0]
    assert got["--block-size"] == str(v.setting(side, "block_size")[0])
    assert got["--max-model-len"] == str(v.max_model_len)
    assert got["--tensor-parallel-size"] == str(role.tensor_parallel_size)
    assert got["--data-parallel-size"] == str(role.data_parallel_size)
    assert ("--enable-expert-parallel" in got) is role.enable_expert_parallel
    assert ("--enable-eplb" in got) is role.enable_eplb
    if role.num_redundant_experts:
        assert json.loads(got["--eplb-config"] or "") == {"num_redundant_experts": role.num_redundant_experts}
    assert "--api-key" not in got  # a secret value never goes in an argv (ps shows it): VLLM_API_KEY, a secret
    words = argv[3:]
    assert all(w.startswith("--") or words[i - 1].startswith("--") for i, w in enumerate(words)), "no positional"
    assert len([w for w in words if w.startswith("--")]) == len(got), "each flag once"


def test_extra_args_pass_through_and_override_the_limits_defaults() -> None:
    got = flags(engine_args(CPU, PoolRole.DECODE, HOST))
    assert "--enforce-eager" in got and got["--enforce-eager"] is None
    assert "--no-enable-prefix-caching" in got  # false: vLLM's BooleanOptionalAction negation
    assert got["--max-num-seqs"] == str(CPU.limits.max_batch_size)
    assert got["--max-num-batched-tokens"] == str(CPU.limits.prefill_token_budget)
    assert CPU.vllm is not None
    tuned = CPU.model_copy(update={"vllm": CPU.vllm.model_copy(update={"extra_args": {"max-num-seqs": 7}})})
    argv = engine_args(tuned, PoolRole.DECODE, HOST)
    assert argv.count("--max-num-seqs") == 1 and flags(argv)["--max-num-seqs"] == "7"


def agent_settings(serving: Serving, side: PoolRole, instance_id: str = "decode-a") -> AgentSettings:
    argv = agent_command(
        serving, side, advertise_host=HOST, scheduler_url="http://10.30.0.2:8100", version="r7", instance_id=instance_id
    )
    assert argv[:3] == (VLLM_PYTHON, "-m", "pdserve.cli") and argv[3] == "agent" and "agent" in cli.CONTROL_ROLES
    return load_settings(AgentSettings, argv[4:], prog="pdserve agent", env={})


@pytest.mark.parametrize(("name", "serving"), servings(), ids=[name for name, _ in servings()])
@pytest.mark.parametrize("side", SIDES)
def test_the_agent_argv_parses_and_agrees_with_the_engine(
    name: str, serving: Serving, side: PoolRole, key_file: Path
) -> None:
    settings = agent_settings(serving, side)
    engine = flags(engine_args(serving, side, HOST))
    assert settings.role == str(side)
    assert settings.engine_url == f"http://127.0.0.1:{engine['--port']}"
    assert settings.advertise_url == f"http://{HOST}:{engine['--port']}"
    assert str(settings.max_num_seqs) == engine["--max-num-seqs"]
    assert settings.connector_run_dir == connector_settings(serving, side, key_file).run_dir
    assert str(settings.scheduler_token_file) == INSTANCE_TOKEN.path
    assert str(settings.engine_token_file) == SERVER_TOKEN.path
    assert (settings.version, settings.registered_id()) == ("r7", "decode-a")


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_over_tls_the_engine_serves_the_nodes_pair_and_the_agent_calls_it_by_name(key_file: Path, mutual: bool) -> None:
    """A node with a certificate: vLLM's API server serves the contract's TLS files (requiring a client certificate
    only under mutual TLS), the connector's KV channel takes the same files, and the agent's own parser gets https
    URLs by the node's name (its certificate carries it, not 127.0.0.1) and the CA and pair for its calls."""
    tls = NodeTls(mutual=mutual)
    assert (tls.cert, tls.key, tls.ca) == tuple(f"{TLS_DIR}/{f}" for f in (TLS_CERT_FILE, TLS_KEY_FILE, TLS_CA_FILE))
    got = flags(engine_args(CPU, PoolRole.PREFILL, HOST, tls))
    assert (got["--ssl-certfile"], got["--ssl-keyfile"], got["--ssl-ca-certs"]) == (tls.cert, tls.key, tls.ca)
    assert "--enable-ssl-refresh" in got and got.get("--ssl-cert-reqs") == ("2" if mutual else None)
    extra = json.loads(got["--kv-transfer-config"] or "")["kv_connector_extra_config"] | {"kv_key_file": str(key_file)}
    connector = ConnectorSettings.of(extra, producer=True, engine_id="e")
    files = (connector.kv_tls_cert, connector.kv_tls_key, connector.kv_tls_ca)
    assert files == (Path(tls.cert), Path(tls.key), Path(tls.ca))
    argv = agent_command(
        CPU,
        PoolRole.PREFILL,
        advertise_host="i-0abc.prefill.dc1.prod.pdstack.internal",
        scheduler_url="https://scheduler.control.prod.pdstack.internal:8100",
        version="r7",
        instance_id="prefill-a",
        tls=tls,
    )
    agent = load_settings(AgentSettings, argv[4:], prog="pdserve agent", env={})
    port = got["--port"]
    assert agent.engine_url == agent.advertise_url == f"https://i-0abc.prefill.dc1.prod.pdstack.internal:{port}"
    assert (str(agent.tls_ca), str(agent.tls_client_cert), str(agent.tls_client_key)) == (tls.ca, tls.cert, tls.key)


def test_the_agent_refuses_a_bad_instance_id_through_its_own_parser() -> None:
    with pytest.raises(SystemExit):
        agent_settings(CPU, PoolRole.DECODE, instance_id="has space")


def test_nixl_gets_its_connector_lease_and_side_channel_and_no_agent() -> None:
    assert CPU.vllm is not None
    nixl = CPU.model_copy(update={"vllm": CPU.vllm.model_copy(update={"kv_connector": KvConnector.NIXL})})
    config = kv_config(nixl, PoolRole.DECODE)
    assert config == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"kv_lease_duration": 30},
    }
    assert engine_env(nixl, PoolRole.PREFILL, HOST) == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl.ports.kv),
    }
    assert engine_env(CPU, PoolRole.PREFILL, HOST) == {}
    with pytest.raises(ValueError, match=r"serving\.vllm\.kv_connector"):
        agent_args(nixl, PoolRole.DECODE, advertise_host=HOST, scheduler_url="http://s:1", version="r", instance_id="i")


def test_a_pdserve_engine_or_a_control_side_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"serving\.engine"):
        engine_args(Serving(model=Model(name="m", path="/m")), PoolRole.DECODE, HOST)
    with pytest.raises(ValueError, match="side"):
        engine_args(CPU, PoolRole.CONTROL, HOST)


@pytest.mark.parametrize(("name", "serving"), servings(), ids=[name for name, _ in servings()])
def test_every_prefill_worker_listens_on_its_own_port_inside_the_rendered_kv_range(
    name: str, serving: Serving, key_file: Path
) -> None:
    """The connector's port rule (pdserve.vllm.settings.kv_port_of) as each of prefill's TP x DP workers applies
    it to the rendered config: distinct ports, exactly the range pdstack opens, each rank in its own run dir."""
    assert serving.vllm is not None
    role = serving.vllm.role(PoolRole.PREFILL)
    tp, dp = role.tensor_parallel_size, role.data_parallel_size
    extra = kv_config(serving, PoolRole.PREFILL)["kv_connector_extra_config"] | {"kv_key_file": str(key_file)}
    workers = [
        ConnectorSettings.of(
            extra, producer=True, engine_id=f"engine_dp{d}", tp_size=tp, dp_index=d, data_parallel=dp > 1
        ).for_rank(r)
        for d in range(dp)
        for r in range(tp)
    ]
    assert sorted(w.port for w in workers) == list(kv_port_range(serving))
    assert len({w.worker_dir for w in workers}) == tp * dp
    assert {w.port for w in workers if w.tp_rank == 0} == {serving.ports.kv + d * tp for d in range(dp)}


def test_a_kv_port_range_past_65535_is_refused_by_the_connector(key_file: Path) -> None:
    extra = {"kv_key_file": str(key_file), "kv_port": 65530}
    with pytest.raises(SettingsError, match=r"^kv_connector_extra_config\.kv_port: 65530: DP engine 0's 8 TP ranks "):
        ConnectorSettings.of(extra, producer=True, engine_id="e", tp_size=8)
