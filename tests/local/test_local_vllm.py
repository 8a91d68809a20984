"""The local environment on vLLM, end to end: `pdstack local up --engine vllm` (`make up ENGINE=vllm`), then a
completion through the gateway with the official openai client: prefilled by vLLM in dc1, its KV across the emulated
WAN through PdstackConnector, decoded by vLLM in dc2, and equal to what a vLLM engine of the same checkpoint
generates colocated (prompt and output on one engine, no KV transfer). Then `up` again changes nothing; canaries of
vLLM releases under load (a good one promoted with no failed request, a slow one rolled back by the judge's TTFT
check, one whose greedy outputs differ rolled back by the golden check); a killed vLLM decode restarted while the
other carries the load; `down` leaves nothing behind.

Opt-in (`make test-local-vllm`, PDSTACK_LOCAL_VLLM=1; tests/local/conftest.py): the vLLM-cpu image and four vLLM
engines take more than CI's time budget. Owns the machine's local environment like test_local_env.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from pdstack.local import nodes
from pdstack.local.engine_choice import vllm_serving
from pdstack.local.model import VLLM_MODEL_NAME
from pdstack.model import PoolRole
from pdstack.vllm import deploy as vllm_deploy
from tests.local.environment import (
    LOAD_RATE,
    Local,
    assert_a_killed_decode_recovers,
    assert_a_warm_up_changes_nothing,
    assert_back_on,
    assert_down_leaves_nothing,
    assert_promoted_under_load,
    brought_up,
)
from tests.local.load import ClientLoad
from tests.local.operator import operator_context

# About 1.9K tokens of the checkpoint's word-level tokenizer: well past the offload threshold (remote prefill), and
# past the 512-token context of the pdserve model, within vLLM's 4K.
PROMPT = "Prefill runs in one datacenter and the decode in the other, the KV cache crosses the link. " * 100
MAX_TOKENS = 16

pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    started = time.monotonic()
    yield from brought_up("--engine", "vllm")
    print(f"pdstack local up --engine vllm and the tests: {time.monotonic() - started:.0f} s")


def client(local: Local) -> OpenAI:
    return OpenAI(base_url=local.status["gateway_url"], api_key=local.api_key(), timeout=120, max_retries=0)


def engine_url(local: Local, role: PoolRole) -> str:
    """A vLLM engine's API by the name its certificate carries (the node's address is in it too)."""
    node = local.topology.nodes_with_role(role)[0]
    port = local.topology.serving.ports.decode if role is PoolRole.DECODE else local.topology.serving.ports.prefill
    return f"https://{node.address.ip}:{port}"


def prometheus_sum(local: Local, query: str) -> float:
    url = f"{local.status['prometheus_url']}/api/v1/query"
    series = local.internal.get(url, params={"query": query}, timeout=10).json()["data"]["result"]
    return sum(float(s["value"][1]) for s in series)


def wan_rx_bytes(local: Local, a: str, b: str) -> int:
    """Bytes datacenter `b`'s router received from its WAN link to `a` (the forwarder's TUN device)."""
    router = local.topology.datacenter(b).router_namespace
    link = next(lk for lk in local.topology.links if {lk.a, lk.b} == {a, b})
    shown = subprocess.run(
        ["ip", "-n", router, "-s", "-j", "link", "show", link.device_towards(a)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(shown)[0]["stats64"]["rx"]["bytes"])


def test_up_reports_the_vllm_engine_and_its_4k_model(local: Local) -> None:
    assert local.status["engine"] == "vllm" and local.status["model"] == VLLM_MODEL_NAME
    assert f"engine:     vllm (model {VLLM_MODEL_NAME})" in local.up_output
    for node in local.topology.nodes_with_role(PoolRole.PREFILL) + local.topology.nodes_with_role(PoolRole.DECODE):
        running = nodes.exec_in_node(node.name, ["podman", "ps", "--format", "{{.Names}}"]).split()
        assert f"vllm-{node.role}" in running and f"vllm-{node.role}-agent" in running, (node.name, running)


def test_a_completion_through_the_gateway_crosses_the_wan_and_equals_vllm_colocated(local: Local) -> None:
    # job, not the connector's role label: Prometheus renames that one exported_role (the target has a role label)
    kv_query = 'sum(pdserve_kv_transfer_bytes_total{job="pdserve-decode"})'
    kv_before = prometheus_sum(local, kv_query)
    wan_before = wan_rx_bytes(local, "dc1", "dc2")
    completion = client(local).completions.create(
        model=VLLM_MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.usage is not None and completion.usage.prompt_tokens > 1024, completion.usage
    assert completion.usage.completion_tokens == MAX_TOKENS
    wan_moved = wan_rx_bytes(local, "dc1", "dc2") - wan_before

    # The same checkpoint and settings, colocated: the prompt straight to a decode engine, no kv_transfer_params
    # (over its TLS, presenting the operator's certificate as the stack's mutual TLS asks).
    token = local.env.secrets.server_api_token.read_text().strip()
    colocated = httpx.post(
        f"{engine_url(local, PoolRole.DECODE)}/v1/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": VLLM_MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
        verify=operator_context(local.status),
    )
    assert colocated.status_code == 200, colocated.text
    assert completion.choices[0].text == colocated.json()["choices"][0]["text"]

    # 4 layers x 2 KV heads x 64 x (K, V) x 4 bytes = 4 KiB of KV per prompt token crossed dc1 -> dc2.
    assert wan_moved >= 4096 * completion.usage.prompt_tokens * 0.9, wan_moved
    deadline = time.monotonic() + 90  # Prometheus scrapes every few seconds
    while (kv_moved := prometheus_sum(local, kv_query) - kv_before) <= 0 and time.monotonic() < deadline:
        time.sleep(3)
    assert kv_moved > 0, f"{kv_query} did not move in Prometheus"
    assert wan_moved >= kv_moved  # the connector's bytes are on the link


def test_up_again_changes_nothing(local: Local) -> None:
    assert_a_warm_up_changes_nothing(local.env, local.topology, "--engine", "vllm")


def test_a_good_vllm_canary_is_promoted_to_all_traffic_with_no_failed_request(local: Local) -> None:
    assert_promoted_under_load(local, "vllm-good", "2", engine="vllm")


def release_settings(local: Local, extra_args: dict[str, Any] | None = None, **vllm: Any) -> dict[str, Any]:
    """Deploy settings for a release of the running image whose vLLM settings differ from the baseline's by `vllm`
    and by `extra_args` added to its extra flags."""
    serving = vllm_serving(local.topology.serving, local.release()["vllm_image"])
    assert serving.vllm is not None
    vllm["extra_args"] = serving.vllm.extra_args | (extra_args or {})
    changed = serving.model_copy(update={"vllm": serving.vllm.model_copy(update=vllm)})
    return {"pdstack_vllm_vars": vllm_deploy.ansible_vars(changed)}


def assert_rolled_back(local: Local, version: str, config: str, settings: dict[str, Any], check: str) -> str:
    """Deploy a bad vLLM release under load: it is rolled back, the report names `check`, no client request failed,
    every node is back on the release it ran before and the canary holds no traffic. Returns the engines' command
    lines."""
    baseline = local.baseline()
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        deployed = local.deploy(version, config, settings=settings)
    output = deployed.stdout + deployed.stderr
    assert deployed.returncode != 0
    assert f"canary {version} rolled back" in output and check in output, output[-6000:]
    assert not load.failures(), load.failures()  # slowness is what the canary's clients got, not errors
    assert_back_on(local, baseline, version)
    commands = ""
    for node, component in local.servers():
        commands += nodes.exec_in_node(node, ["podman", "inspect", "--format", "{{.Config.Cmd}}", f"vllm-{component}"])
    return commands


def test_a_slow_vllm_canary_is_rolled_back_by_the_judge_under_load(local: Local) -> None:
    """A release that lets vLLM compute 4 prompt tokens a step (a mistuned max-num-batched-tokens): its outputs
    equal the baseline's, so it passes the golden check and takes traffic, and its prefills take many more steps,
    so the judge fails its TTFT p95 against the baseline's and the canary returns to the baseline's command lines.
    (Measured colocated on the local checkpoint: TTFT p50 0.04 -> 0.17 s for the load's prompts.)"""
    slow = release_settings(local, extra_args={"max-num-batched-tokens": 4, "max-num-seqs": 4})
    commands = assert_rolled_back(local, "vllm-slow-3", "3", slow, "FAIL ttft_p95")
    assert "--max-num-batched-tokens 4 " not in commands, commands


def test_a_vllm_canary_whose_outputs_differ_is_rolled_back_by_the_golden_check(local: Local) -> None:
    """A release that serves the model in bfloat16 rather than float32: both canary engines start (their
    fingerprints match each other, not the baseline's), but their greedy outputs differ from the baseline's, so the
    canary gets no traffic and returns to the baseline's command lines."""
    commands = assert_rolled_back(local, "vllm-bf16-4", "4", release_settings(local, dtype="bfloat16"), "golden")
    assert "bfloat16" not in commands and "float32" in commands, commands


def test_a_killed_vllm_decode_is_restarted_and_requests_recover(local: Local) -> None:
    assert_a_killed_decode_recovers(local, "vllm-decode", restart_s=420)  # vLLM loads for 1-3 minutes here


def test_down_leaves_no_container_namespace_link_or_rule(local: Local) -> None:
    assert_down_leaves_nothing(local)
