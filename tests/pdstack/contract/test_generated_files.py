"""The files pdstack renders for Ansible and the policy pack (playbooks/vars/contract, playbooks/vars/vllm,
policy/config) are committed exactly as their renderers write them today, nothing else sits in their folders, and the
YAML among them passes ansible-lint's yaml rule (the yamllint configuration ansible-lint applies)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdstack.contract.files import CONTRACT_VARS_DIR, POLICY_CONFIG_DIR, all_rendered_files
from pdstack.vllm import deploy
from tests.support import REPO

GENERATED_DIRS = (CONTRACT_VARS_DIR, deploy.VARS_DIR, POLICY_CONFIG_DIR)
RENDER_COMMANDS = "`python -m pdstack.contract.files` and `python -m pdstack.vllm.deploy`"
# ansiblelint imports ansible, which replaces sys.intern with an object torch._dynamo cannot load beside: the check
# runs in a process of its own so that the suites importing torch later in this one are untouched.
YAML_RULE = """
import sys
from ansiblelint.yaml_utils import load_yamllint_config
from yamllint import linter
config = load_yamllint_config()
for path in sys.argv[1:]:
    with open(path) as file:
        for problem in linter.run(file.read(), config):
            print(f"{path}:{problem.line}: {problem.desc} ({problem.rule})")
"""


def rendered() -> dict[Path, str]:
    return all_rendered_files(REPO) | deploy.rendered_files(REPO)


def test_every_generated_file_is_committed_as_rendered_and_nothing_else() -> None:
    files = rendered()
    committed = {path for folder in GENERATED_DIRS for path in (REPO / folder).iterdir()}
    assert committed == set(files), f"files no renderer writes, or not committed: run {RENDER_COMMANDS}"
    stale = [str(path.relative_to(REPO)) for path, text in files.items() if path.read_text() != text]
    assert stale == [], f"run {RENDER_COMMANDS}"


def test_the_rendered_yaml_passes_ansible_lints_yaml_rule(tmp_path: Path) -> None:
    written = []
    for path, text in rendered().items():
        if path.suffix == ".yml":
            written.append(tmp_path / path.relative_to(REPO))
            written[-1].parent.mkdir(parents=True, exist_ok=True)
            written[-1].write_text(text)
    assert written, "no rendered YAML to check"
    command = [sys.executable, "-c", YAML_RULE, *map(str, written)]
    lint = subprocess.run(command, capture_output=True, text=True, check=False)
    assert lint.returncode == 0, lint.stderr
    assert lint.stdout.replace(f"{tmp_path}/", "").splitlines() == []
