"""The local environment on vLLM, end to end: `pdstack local up --engine vllm` (`make up ENGINE=vllm`), then a
completion through the gateway with the official openai client: prefilled by vLLM in dc1, its KV across the emulated
WAN through PdstackConnector, decoded by vLLM in dc2, and equal to what a vLLM engine of the same checkpoint
generates colocated (prompt and output on one engine, no KV transfer). Then `up` again changes nothing, and `down`
leaves nothing behind.

Opt-in (`make test-local-vllm`, PDSTACK_LOCAL_VLLM=1; tests/local/conftest.py): the vLLM-cpu image and four vLLM
engines take more than CI's time budget. Owns the machine's local environment like test_local_env.py.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from pdstack.local import nodes
from pdstack.local.env import LocalEnv
from pdstack.local.model import VLLM_MODEL_NAME
from pdstack.local.network import namespaces
from pdstack.local.topology import Topology
from pdstack.model import PoolRole
from tests.local.operator import operator_context
from tests.local.test_local_env import assert_a_warm_up_changes_nothing, pdstack

REPO = Path(__file__).resolve().parents[2]
PDSTACK = str(REPO / ".venv" / "bin" / "pdstack")
# About 1.5K tokens of the checkpoint's tokenizer: well past the offload threshold (remote prefill), and past the
# 512-token context of the pdserve model, within vLLM's 4K.
PROMPT = "Prefill runs in one datacenter and the decode in the other, the KV cache crosses the link. " * 40
MAX_TOKENS = 16

pytestmark = pytest.mark.timeout(3600)


@dataclass
class LocalVllm:
    env: LocalEnv
    topology: Topology
    up_output: str
    status: dict[str, Any]

    def client(self) -> OpenAI:
        key = Path(self.status["api_key_file"]).read_text().strip()
        return OpenAI(base_url=self.status["gateway_url"], api_key=key, timeout=120, max_retries=0)

    def engine_url(self, role: PoolRole) -> str:
        node = self.topology.nodes_with_role(role)[0]
        port = self.topology.serving.ports.decode if role is PoolRole.DECODE else self.topology.serving.ports.prefill
        return f"http://{node.address.ip}:{port}"

    def prometheus_sum(self, query: str) -> float:
        url = f"{self.status['prometheus_url']}/api/v1/query"
        result = httpx.get(url, params={"query": query}, timeout=10, verify=operator_context(self.status))
        series = result.json()["data"]["result"]
        return sum(float(s["value"][1]) for s in series)


def wan_rx_bytes(local: LocalVllm, a: str, b: str) -> int:
    """Bytes datacenter `b`'s router received from its WAN link to `a` (the forwarder's TUN device)."""
    router = local.topology.datacenter(b).router_namespace
    link = next(lk for lk in local.topology.links if {lk.a, lk.b} == {a, b})
    shown = subprocess.run(["ip", "-n", router, "-s", "-j", "link", "show", link.device_towards(a)],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    return int(json.loads(shown)[0]["stats64"]["rx"]["bytes"])


@pytest.fixture(scope="module")
def local() -> Iterator[LocalVllm]:
    started = time.monotonic()
    up = pdstack("local", "up", "--engine", "vllm")
    print(f"pdstack local up --engine vllm: {time.monotonic() - started:.0f} s")
    assert up.returncode == 0, (up.stdout + up.stderr)[-6000:]
    status = json.loads(pdstack("local", "status", "--json").stdout)
    env = LocalEnv(REPO)
    yield LocalVllm(env, env.topology(), up.stdout + up.stderr, status)


def test_up_reports_the_vllm_engine_and_its_4k_model(local: LocalVllm) -> None:
    assert local.status["engine"] == "vllm" and local.status["model"] == VLLM_MODEL_NAME
    assert f"engine:     vllm (model {VLLM_MODEL_NAME})" in local.up_output
    for node in local.topology.nodes_with_role(PoolRole.PREFILL) + local.topology.nodes_with_role(PoolRole.DECODE):
        running = nodes.exec_in_node(node.name, ["podman", "ps", "--format", "{{.Names}}"]).split()
        assert f"vllm-{node.role}" in running and f"vllm-{node.role}-agent" in running, (node.name, running)


def test_a_completion_through_the_gateway_crosses_the_wan_and_equals_vllm_colocated(local: LocalVllm) -> None:
    # job, not the connector's role label: Prometheus renames that one exported_role (the target has a role label)
    kv_query = 'sum(pdserve_kv_transfer_bytes_total{job="pdserve-decode"})'
    kv_before = local.prometheus_sum(kv_query)
    wan_before = wan_rx_bytes(local, "dc1", "dc2")
    completion = local.client().completions.create(
        model=VLLM_MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert completion.usage is not None and completion.usage.prompt_tokens > 1024, completion.usage
    assert completion.usage.completion_tokens == MAX_TOKENS
    wan_moved = wan_rx_bytes(local, "dc1", "dc2") - wan_before

    # The same checkpoint and settings, colocated: the prompt straight to a decode engine, no kv_transfer_params.
    token = local.env.secrets.server_api_token.read_text().strip()
    colocated = httpx.post(
        f"{local.engine_url(PoolRole.DECODE)}/v1/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": VLLM_MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    )
    assert colocated.status_code == 200, colocated.text
    assert completion.choices[0].text == colocated.json()["choices"][0]["text"]

    # 4 layers x 2 KV heads x 64 x (K, V) x 4 bytes = 4 KiB of KV per prompt token crossed dc1 -> dc2.
    assert wan_moved >= 4096 * completion.usage.prompt_tokens * 0.9, wan_moved
    deadline = time.monotonic() + 90  # Prometheus scrapes every few seconds
    while (kv_moved := local.prometheus_sum(kv_query) - kv_before) <= 0 and time.monotonic() < deadline:
        time.sleep(3)
    assert kv_moved > 0, f"{kv_query} did not move in Prometheus"
    assert wan_moved >= kv_moved  # the connector's bytes are on the link


def test_up_again_changes_nothing(local: LocalVllm) -> None:
    assert_a_warm_up_changes_nothing(local.env, local.topology, "--engine", "vllm")


def test_down_leaves_no_container_namespace_link_or_rule(local: LocalVllm) -> None:
    down = pdstack("local", "down")
    assert down.returncode == 0, down.stderr[-3000:]
    assert not any(nodes.node_exists(n.name) for n in local.topology.nodes)
    assert not [ns for ns in namespaces() if ns.startswith("pds")]
    assert local.env.network(local.topology).leftovers() == []
    assert not local.env.registry().healthy()
