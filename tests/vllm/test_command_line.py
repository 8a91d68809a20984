"""The engine argv pdstack renders (pdstack/vllm/command.py) is what vLLM 0.32's own `vllm serve` parser accepts, and
parses to the stack's settings: vLLM's make_arg_parser, its pre-start checks and AsyncEngineArgs.from_cli_args, as
the API server runs them before loading anything. No server starts (the parser alone, built once per module).
The allowlisted extra flags and the flags pdstack owns (pdstack.model) are flags of this parser too."""

from __future__ import annotations

import argparse
import importlib
import json
import ssl
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

from pdstack.contract.files import environment_serving
from pdstack.model import EXTRA_FLAGS, OWNED_FLAGS, Engine, KvConnector, Model, PoolRole, Serving, Tracing, Vllm
from pdstack.vllm.command import API_SERVER, NodeTls, engine_args, engine_command, engine_env
from tests.support import STACKS

HOST = "10.20.1.7"
CPU = Serving(
    model=Model(name="tiny", path="/var/lib/pdstack/models/tiny"),
    engine=Engine.VLLM,
    vllm=Vllm(
        image="localhost/pdstack-vllm-cpu@sha256:" + "ab" * 32,
        version="0.32.0",
        dtype="float32",
        max_model_len=12288,
        block_size=32,
        extra_args={"enforce-eager": True, "enable-prefix-caching": False},
    ),
)


def _nixl(serving: Serving) -> Serving:
    assert serving.vllm is not None
    return serving.model_copy(update={"vllm": serving.vllm.model_copy(update={"kv_connector": KvConnector.NIXL})})


SERVINGS = {env: environment_serving(STACKS, env) for env in ("dev", "staging", "prod")} | {"cpu": CPU}
SERVINGS["prod-nixl"] = _nixl(SERVINGS["prod"])


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    """The API server's parser, as vllm.entrypoints.launchers.api_server.entry.main builds it."""
    return make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))


def parsed(parser: FlexibleArgumentParser, argv: tuple[str, ...]) -> argparse.Namespace:
    args = parser.parse_args(list(argv))
    validate_parsed_serve_args(args)
    return args


@pytest.mark.parametrize("name", list(SERVINGS))
@pytest.mark.parametrize("side", [PoolRole.PREFILL, PoolRole.DECODE])
def test_vllm_parses_the_rendered_argv_to_the_stacks_settings(
    parser: FlexibleArgumentParser, name: str, side: PoolRole
) -> None:
    serving = SERVINGS[name]
    v = serving.vllm
    assert v is not None
    command = engine_command(serving, side, HOST)
    assert command[1:3] == ("-m", API_SERVER)
    engine = AsyncEngineArgs.from_cli_args(parsed(parser, command[3:]))
    role = v.role(side)
    assert (engine.model, engine.served_model_name) == (serving.model.path, [serving.model.name])
    assert (engine.dtype, engine.block_size) == (v.setting(side, "dtype")[0], v.setting(side, "block_size")[0])
    assert (engine.max_model_len, engine.kv_cache_dtype) == (v.max_model_len, v.kv_cache_dtype)
    assert engine.gpu_memory_utilization == v.setting(side, "gpu_memory_utilization")[0]
    assert (engine.tensor_parallel_size, engine.data_parallel_size) == (
        role.tensor_parallel_size,
        role.data_parallel_size,
    )
    assert (engine.enable_expert_parallel, engine.enable_eplb) == (role.enable_expert_parallel, role.enable_eplb)
    assert engine.eplb_config.num_redundant_experts == role.num_redundant_experts
    assert engine.max_num_seqs == v.extra_args.get("max-num-seqs", serving.limits.max_batch_size)
    kv = engine.kv_transfer_config
    assert kv is not None
    assert kv.kv_role == ("kv_producer" if side is PoolRole.PREFILL else "kv_consumer")
    assert kv.kv_load_failure_policy == serving.kv_load_failure_policy
    rendered: dict[str, Any] = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert kv.kv_connector_extra_config == rendered["kv_connector_extra_config"]
    if v.kv_connector is KvConnector.PDSTACK:
        connector = getattr(importlib.import_module(kv.kv_connector_module_path or ""), kv.kv_connector or "")
        assert issubclass(connector, KVConnectorBase_V1)
    else:
        assert (kv.kv_connector, kv.kv_connector_module_path) == ("NixlConnector", None)


def test_with_tracing_vllm_exports_to_the_stacks_endpoint(parser: FlexibleArgumentParser) -> None:
    endpoint = "http://collector.internal:4318/v1/traces"
    traced = CPU.model_copy(update={"tracing": Tracing(otlp_endpoint=endpoint, sample_ratio=0.5)})
    for side in (PoolRole.PREFILL, PoolRole.DECODE):
        engine = AsyncEngineArgs.from_cli_args(parsed(parser, engine_args(traced, side, HOST)))
        assert engine.otlp_traces_endpoint == endpoint
        assert engine_env(traced, side, HOST)["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert AsyncEngineArgs.from_cli_args(parsed(parser, engine_args(CPU, side, HOST))).otlp_traces_endpoint is None


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_over_tls_vllms_api_server_serves_the_nodes_pair(parser: FlexibleArgumentParser, mutual: bool) -> None:
    """What vLLM's own parser makes of NodeTls' flags: the contract's files, re-read as they change, and a client
    certificate required (ssl.CERT_REQUIRED) only under the stack's mutual TLS."""
    tls = NodeTls(mutual=mutual)
    args = parsed(parser, engine_args(CPU, PoolRole.DECODE, HOST, tls))
    assert (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs) == (tls.cert, tls.key, tls.ca)
    assert args.enable_ssl_refresh is True
    assert args.ssl_cert_reqs == (ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE)
    assert parsed(parser, engine_args(CPU, PoolRole.DECODE, HOST)).ssl_certfile is None


def test_cpu_extra_args_reach_vllm(parser: FlexibleArgumentParser) -> None:
    engine = AsyncEngineArgs.from_cli_args(parsed(parser, engine_args(CPU, PoolRole.DECODE, HOST)))
    assert (engine.enforce_eager, engine.enable_prefix_caching) == (True, False)
    assert engine.max_num_batched_tokens == CPU.limits.prefill_token_budget


def test_vllm_builds_its_engine_config_from_the_cpu_argv_on_a_real_checkpoint(
    parser: FlexibleArgumentParser, model_dir: Path
) -> None:
    """What the API server does next, before starting the engine: resolve the model, cache and scheduler config."""
    assert CPU.vllm is not None
    serving = CPU.model_copy(
        update={
            "model": Model(name="tiny", path=str(model_dir)),
            "vllm": CPU.vllm.model_copy(update={"max_model_len": 2048}),
        }
    )
    for side in (PoolRole.PREFILL, PoolRole.DECODE):
        config = AsyncEngineArgs.from_cli_args(parsed(parser, engine_args(serving, side, HOST))).create_engine_config()
        assert (config.cache_config.block_size, config.model_config.max_model_len) == (32, 2048)
        assert str(config.model_config.dtype) == "torch.float32"
        assert config.scheduler_config.max_num_seqs == serving.limits.max_batch_size
        assert config.scheduler_config.max_num_batched_tokens == serving.limits.prefill_token_budget
        assert config.kv_transfer_config is not None
        assert config.kv_transfer_config.kv_role == ("kv_producer" if side is PoolRole.PREFILL else "kv_consumer")


def _sample(kind: type) -> list[str]:
    return [] if kind is bool else ["1" if kind is int else "naive"]


@pytest.mark.parametrize("flag", list(EXTRA_FLAGS))
def test_every_allowed_extra_flag_is_a_vllm_flag_of_its_type(parser: FlexibleArgumentParser, flag: str) -> None:
    kind = EXTRA_FLAGS[flag]
    args = parsed(parser, ("--model", "/m", f"--{flag}", *_sample(kind)))
    value = getattr(args, flag.replace("-", "_"))
    assert value == (True if kind is bool else kind(_sample(kind)[0]))
    if kind is bool:  # pdstack renders false as --no-<flag>
        assert getattr(parsed(parser, ("--model", "/m", f"--no-{flag}")), flag.replace("-", "_")) is False


def test_every_flag_pdstack_owns_is_a_vllm_flag(parser: FlexibleArgumentParser) -> None:
    known = {option for action in parser._actions for option in action.option_strings}
    assert {f"--{flag}" for flag in OWNED_FLAGS} - known == set()
