"""The local environment's engine switch (pdstack/local/engine_choice.py), without bringing anything up: which engine a
run gets, and the vLLM serving block and release vars `up --engine vllm` deploys from the local stacks."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pdstack.cli import app
from pdstack.contract.files import environment_serving
from pdstack.local.engine_choice import (
    CONTRACT_VALUES,
    LOCAL_VLLM_SIZING,
    VLLM_VALUES,
    EngineError,
    bundle_values,
    resolve_engine,
    vllm_release_vars,
    vllm_serving,
)
from pdstack.local.inventory import PLATFORM_FILE
from pdstack.local.model import VLLM_MAX_MODEL_LEN, VLLM_MODEL_NAME
from pdstack.model import Engine, PoolRole, Serving, Vllm
from pdstack.node.bundle import BundleError, build_bundle, read_member
from tests.support import REPO

IMAGE = "10.210.255.1:5000/pdstack/vllm@sha256:" + "ab" * 32


@pytest.fixture
def stack_serving() -> Serving:
    return environment_serving(REPO / "stacks", "local")


def test_the_stack_decides_unless_the_run_overrides(stack_serving: Serving) -> None:
    assert stack_serving.engine is Engine.PDSERVE  # the local default, until the lead moves it
    assert resolve_engine(stack_serving, None) is Engine.PDSERVE
    assert resolve_engine(stack_serving, "") is Engine.PDSERVE  # make up without ENGINE passes nothing
    assert resolve_engine(stack_serving, "vllm") is Engine.VLLM


def test_an_unknown_engine_is_refused_naming_the_option(stack_serving: Serving) -> None:
    with pytest.raises(EngineError, match=r"--engine \(ENGINE\): 'vlm' is not an engine; choose one of pdserve, vllm"):
        resolve_engine(stack_serving, "vlm")


def test_up_refuses_an_unknown_engine_before_touching_the_machine() -> None:
    result = CliRunner().invoke(app, ["local", "up", "--stacks", str(REPO / "stacks"), "--engine", "tgi"])
    assert result.exit_code == 1
    assert "--engine (ENGINE): 'tgi' is not an engine" in result.output


def test_the_vllm_serving_block_serves_the_4k_checkpoint_from_the_pushed_image(stack_serving: Serving) -> None:
    serving = vllm_serving(stack_serving, IMAGE)
    assert serving.engine is Engine.VLLM and serving.vllm is not None
    assert serving.vllm.image == IMAGE and serving.vllm.dtype == "float32" and serving.vllm.block_size == 32
    assert serving.vllm.max_model_len == VLLM_MAX_MODEL_LEN >= 4096
    assert serving.model.name == VLLM_MODEL_NAME
    assert serving.limits.max_prompt_tokens + serving.limits.max_output_tokens == VLLM_MAX_MODEL_LEN
    # everything else is the stack's: ports, offload threshold, KV streams, tracing
    assert (serving.ports, serving.offload_threshold_tokens, serving.tracing) == (
        stack_serving.ports,
        stack_serving.offload_threshold_tokens,
        stack_serving.tracing,
    )


def test_a_stack_vllm_block_keeps_its_settings_with_the_local_image(stack_serving: Serving) -> None:
    own = Vllm(
        image="example.com/vllm@sha256:" + "0" * 64,
        version="0.32.0",
        dtype="bfloat16",
        max_model_len=8192,
        block_size=64,
    )
    on_vllm = stack_serving.model_copy(update={"engine": Engine.VLLM, "vllm": own})
    serving = vllm_serving(on_vllm, IMAGE)
    assert serving.vllm is not None
    assert (serving.vllm.image, serving.vllm.dtype, serving.vllm.max_model_len) == (IMAGE, "bfloat16", 8192)


def test_release_vars_turn_the_model_plays_to_vllm_pinned_one_core_per_side(stack_serving: Serving) -> None:
    release = vllm_release_vars(vllm_serving(stack_serving, IMAGE), None)
    assert release["pdstack_vllm_vars"]["pdstack_engine"] == "vllm"
    sides = release["pdstack_vllm_vars"]["vllm_engine_stack"]["sides"]
    assert "PdstackConnector" in " ".join(sides[str(PoolRole.PREFILL)]["engine"]["command"])
    assert release["pdstack_contract"]["pdserve_components"]["gateway"]["port"] == stack_serving.ports.gateway
    assert release["vllm_engine_cpuset_cpus"] == "{{ '0' if pdstack_role == 'prefill' else '1' }}"
    assert release["vllm_engine_cpu_kvcache_space_gib"] == 1
    # the committed vars stay what the stacks render (pdserve): the vLLM ones come only through the release
    committed = yaml.safe_load((REPO / "playbooks" / "vars" / "vllm" / "local.yml").read_text())
    assert committed == {"pdstack_engine": "pdserve"}


def test_a_node_booting_into_a_vllm_release_carries_its_values_and_sizing(
    stack_serving: Serving, tmp_path: Path
) -> None:
    """`up --engine vllm` on a pdserve stack: the bundle a node boots from carries the release's contract and vLLM
    values in place of the committed ones (nothing else changes), its platform values the same sizing as the
    operators' plays get; only the environment's rendered values may be replaced."""
    release = vllm_release_vars(vllm_serving(stack_serving, IMAGE), None)
    assert bundle_values({"pdstack_release": {}}) == {}
    values = bundle_values(release)
    built = build_bundle(REPO, "local", tmp_path / "vllm", wheels=False, rendered=values)
    stock = build_bundle(REPO, "local", tmp_path / "stock", wheels=False)
    assert yaml.safe_load(read_member(built.path, VLLM_VALUES)) == release["pdstack_vllm_vars"]
    assert yaml.safe_load(read_member(built.path, CONTRACT_VALUES)) == release["pdstack_contract"]
    ours, theirs = contents(built.path), contents(stock.path)
    assert [name for name, data in ours.items() if theirs[name] != data] == sorted(values)
    platform = yaml.safe_load((REPO / PLATFORM_FILE).read_text())
    assert {k: platform[k] for k in LOCAL_VLLM_SIZING} == {k: release[k] for k in LOCAL_VLLM_SIZING}
    with pytest.raises(BundleError, match=r"ansible\.cfg"):
        build_bundle(REPO, "local", tmp_path / "bad", wheels=False, rendered={"ansible.cfg": ""})


def contents(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
