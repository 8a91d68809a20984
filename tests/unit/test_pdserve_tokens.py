"""The deployer's token filter (roles/pdserve/filter_plugins) derives exactly the tokens the scheduler accepts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from ansible.errors import AnsibleFilterError
from hypothesis import given
from hypothesis import strategies as st

from pdserve.scheduler import identity
from tests.conftest import REPO

PLUGIN = REPO / "roles" / "pdserve" / "filter_plugins" / "pdserve_tokens.py"
KEYS = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=64
)
PRINCIPALS = st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)


def load_plugin() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pdserve_tokens", PLUGIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PDSERVE_PRINCIPAL_TOKEN = load_plugin().pdserve_principal_token


@given(key=KEYS, principal=PRINCIPALS)
def test_filter_equals_the_schedulers_derivation(key: str, principal: str) -> None:
    token = PDSERVE_PRINCIPAL_TOKEN(key, principal)
    assert token == identity.derive_token(key, principal)
    assert identity.principal_of(key, token) == principal


def test_the_key_file_newline_is_not_part_of_the_key() -> None:
    # The scheduler strips its key file; a key written with a trailing newline must derive the same tokens.
    assert PDSERVE_PRINCIPAL_TOKEN("k3y\n", "gateway") == identity.derive_token("k3y", "gateway")


@pytest.mark.parametrize(("key", "principal", "message"), [
    ("", "gateway", "identity key is empty"),
    ("k", "instance:decode 1", "must be 1..128 characters"),
    ("k", "", "must be 1..128 characters"),
    ("k", "x" * 129, "must be 1..128 characters"),
])  # fmt: skip
def test_bad_input_fails_naming_the_problem(key: str, principal: str, message: str) -> None:
    with pytest.raises(AnsibleFilterError, match=message):
        PDSERVE_PRINCIPAL_TOKEN(key, principal)


def test_ansible_finds_the_filter_through_the_role(tmp_path: Path) -> None:
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "derive", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "tasks": [
            {"name": "load the role's plugins", "ansible.builtin.import_role": {"name": "pdserve",
                                                                                "tasks_from": "pinning.yml"}},
            {"name": "derive", "ansible.builtin.debug": {
                "msg": "{{ 'k3y' | pdserve_principal_token('instance:decode-node-1-0123abcd') }}"}},
        ],
    }]))  # fmt: skip
    result = subprocess.run(
        [str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", str(playbook),
         "-e", json.dumps({"pdserve_component": "decode", "ansible_python_interpreter": "/usr/bin/python3"})],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
             "HOME": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert identity.derive_token("k3y", "instance:decode-node-1-0123abcd") in result.stdout
