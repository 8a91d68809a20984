"""What roles/vllm_engine deploys on a vLLM prefill or decode node, rendered once from the stack's `serving` block.

The two containers' command lines come from pdstack.vllm.command (which takes them from the stack and the contract);
this module renders them for Ansible, committed per environment as playbooks/vars/vllm/<env>.yml, with what differs
per node left as placeholders (PLACEHOLDERS) that the role fills with its own variables: the node's address, the
scheduler's URL, the release and the instance id. So no flag, port or path is typed in the role, and a test keeps
the committed files equal to what the stacks render (tests/pdstack/vllm/test_deploy.py), as for the contract's vars.

Which secret each container gets follows from its argv: a secret file is mounted where the command line names its
path (the engine reads the KV key and, through a shell that exports it as vLLM's API key, the server token:
command.ENGINE_SECRET_ENV; the agent its scheduler token and the server token).

    python -m pdstack.vllm.deploy [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pdstack.contract.components import TLS_DIR, kv_port_range
from pdstack.contract.files import environment_serving, environments, sync_files
from pdstack.contract.yamlfiles import dump_yaml
from pdstack.model import Engine, KvConnector, PoolRole, Serving
from pdstack.vllm.command import (
    AGENT_MODULE,
    API_SERVER,
    ENGINE_SECRET_ENV,
    RUN_DIR,
    VLLM_PYTHON,
    NodeTls,
    agent_args,
    engine_args,
    engine_env,
    http_port,
    secret_files,
)

VARS_DIR = Path("playbooks") / "vars" / "vllm"
HEADER = (
    "# Rendered by `python -m pdstack.vllm.deploy` from stacks/Pulumi.{env}-*.yaml (pdstack/vllm/deploy.py); "
    "do not edit by hand.\n"
)
SIDES = (PoolRole.PREFILL, PoolRole.DECODE)
HEALTH_PATH = "/health"  # vLLM's API server: 200 once the model is loaded and the engine answers
# What the role fills in per node (roles/vllm_engine/vars/main.yml replaces each with its variable's value).
ADVERTISE_HOST = "@ADVERTISE_HOST@"
SCHEDULER_URL = "@SCHEDULER_URL@"
VERSION = "@VERSION@"
INSTANCE_ID = "@INSTANCE_ID@"
PLACEHOLDERS = (ADVERTISE_HOST, SCHEDULER_URL, VERSION, INSTANCE_ID)


def _mounted_in(argv: tuple[str, ...], side: PoolRole) -> list[str]:
    """The stack secrets whose files this command line reads (their path appears in it)."""
    return [s.secret for s in secret_files(side) if any(s.path in word for word in argv)]


def _agent(serving: Serving, side: PoolRole, tls: NodeTls | None) -> dict[str, Any] | None:
    if serving.vllm is not None and serving.vllm.kv_connector is KvConnector.NIXL:
        return None  # command.agent_args refuses it: NixlConnector writes no instance.json to register
    args = agent_args(
        serving,
        side,
        advertise_host=ADVERTISE_HOST,
        scheduler_url=SCHEDULER_URL,
        version=VERSION,
        instance_id=INSTANCE_ID,
        tls=tls,
    )
    return {"entrypoint": VLLM_PYTHON, "command": ["-m", AGENT_MODULE, *args], "secret_files": _mounted_in(args, side)}


SHELL = "/bin/sh"


def _engine_wrapper() -> list[str]:
    """vLLM takes its API key only as a value (VLLM_API_KEY). A podman environment secret would show that value in
    `podman inspect` (measured with podman 4.3), so the engine mounts the key as a file and a shell exports it
    before exec'ing vLLM (PID 1 stays vLLM's API server)."""
    exports = "; ".join(f'export {name}="$(cat {s.path})"' for name, s in ENGINE_SECRET_ENV.items())
    return ["-c", f'{exports}; exec "$@"', "vllm-engine", VLLM_PYTHON, "-m", API_SERVER]


def _engine(serving: Serving, side: PoolRole, tls: NodeTls | None) -> dict[str, Any]:
    args = engine_args(serving, side, ADVERTISE_HOST, tls, VERSION)
    return {
        "entrypoint": SHELL,
        "command": [*_engine_wrapper(), *args],
        "env": engine_env(serving, side, ADVERTISE_HOST),
        "secret_files": _mounted_in((*_engine_wrapper(), *args), side),
    }


def side_vars(serving: Serving, side: PoolRole) -> dict[str, Any]:
    """One side's containers: the engine's argv after the image's entry point, its environment and secrets, and
    the agent's entry point, argv and secrets (None where there is no agent: kv_connector nixl); under `tls` the
    same for a node with a certificate (vLLM's API server and KV channel with the node's pair, the agent over
    https; the stack's mutual TLS makes the API server require a client certificate)."""
    assert serving.vllm is not None
    tls = NodeTls(mutual=serving.mutual_tls)
    kv_ports = kv_port_range(serving) if side is PoolRole.PREFILL else range(0)
    role = serving.vllm.role(side)
    return {
        "port": http_port(serving, side),
        "kv_ports": [kv_ports.start, kv_ports.stop - 1] if kv_ports else [],
        # vLLM's local world on one node: its ranks' CPU lists (VLLM_CPU_OMP_THREADS_BIND) on CPU nodes
        "world_size": role.tensor_parallel_size * role.data_parallel_size,
        "engine": _engine(serving, side, None),
        "agent": _agent(serving, side, None),
        "tls": {"engine": _engine(serving, side, tls), "agent": _agent(serving, side, tls)},
    }


def ansible_vars(serving: Serving) -> dict[str, Any]:
    """`pdstack_engine`, and for vLLM `vllm_engine_stack`: the release the stack pins and each side's containers."""
    if serving.engine is not Engine.VLLM or serving.vllm is None:
        return {"pdstack_engine": str(serving.engine)}
    v = serving.vllm
    stack = {
        "image": v.image,
        "vllm_version": v.version,
        "kv_connector": str(v.kv_connector),
        "model_path": serving.model.path,
        "run_dir": RUN_DIR,
        "health_path": HEALTH_PATH,
        "python": VLLM_PYTHON,  # both images' interpreter: the engine container's health check runs it
        "tls_dir": TLS_DIR,  # where both containers mount the node's TLS folder (NodeTls' files)
        "placeholders": {
            "address": ADVERTISE_HOST,
            "scheduler_url": SCHEDULER_URL,
            "version": VERSION,
            "instance_id": INSTANCE_ID,
        },
        "sides": {str(side): side_vars(serving, side) for side in SIDES},
    }
    return {"pdstack_engine": str(serving.engine), "vllm_engine_stack": stack}


def render(env: str, serving: Serving) -> str:
    return HEADER.format(env=env) + dump_yaml(ansible_vars(serving), width=120)


def rendered_files(project: Path) -> dict[Path, str]:
    stacks = project / "stacks"
    return {
        project / VARS_DIR / f"{env}.yml": render(env, environment_serving(stacks, env)) for env in environments(stacks)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdstack.vllm.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", type=Path, default=Path.cwd(), help="the pdstack checkout (default: here)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a rendered file is out of date")
    args = parser.parse_args(argv)
    stale = sync_files(rendered_files(args.project), args.check)
    for name in stale:
        print(("stale: " if args.check else "wrote ") + name)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
