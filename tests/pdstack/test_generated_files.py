"""The files pdstack renders for Ansible and the policy pack (playbooks/vars/contract, playbooks/vars/vllm,
policy/config) are committed exactly as their renderers write them today, nothing else sits in their folders, and the
YAML among them passes ansible-lint's yaml rule (the yamllint configuration ansible-lint applies)."""

from __future__ import annotations

from pathlib import Path

from ansiblelint.yaml_utils import load_yamllint_config
from yamllint import linter

from pdstack import contract_files, vllm_deploy
from tests.support import REPO

GENERATED_DIRS = (contract_files.CONTRACT_VARS_DIR, vllm_deploy.VARS_DIR, contract_files.POLICY_CONFIG_DIR)
RENDER_COMMANDS = "`python -m pdstack.contract_files` and `python -m pdstack.vllm_deploy`"


def rendered() -> dict[Path, str]:
    return contract_files.all_rendered_files(REPO) | vllm_deploy.rendered_files(REPO)


def test_every_generated_file_is_committed_as_rendered_and_nothing_else() -> None:
    files = rendered()
    committed = {path for folder in GENERATED_DIRS for path in (REPO / folder).iterdir()}
    assert committed == set(files), f"files no renderer writes, or not committed: run {RENDER_COMMANDS}"
    stale = [str(path.relative_to(REPO)) for path, text in files.items() if path.read_text() != text]
    assert stale == [], f"run {RENDER_COMMANDS}"


def test_the_rendered_yaml_passes_ansible_lints_yaml_rule() -> None:
    config = load_yamllint_config()
    problems = [
        f"{path.relative_to(REPO)}:{problem.line}: {problem.desc} ({problem.rule})"
        for path, text in rendered().items()
        if path.suffix == ".yml"
        for problem in linter.run(text, config)
    ]
    assert problems == []
