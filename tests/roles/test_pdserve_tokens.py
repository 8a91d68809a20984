"""The deployer's token filter (roles/serving_node/filter_plugins) derives exactly the tokens the scheduler accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler import identity
from tests.support import REPO
from tests.support.ansible import run_local_playbook

PLUGIN = REPO / "roles" / "serving_node" / "filter_plugins" / "pdserve_tokens.py"
KEYS = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Zs", "Zl", "Zp", "Cc")), min_size=1, max_size=64
)
PRINCIPALS = st.just("gateway") | st.from_regex(r"instance:[A-Za-z0-9._:-]{1,119}", fullmatch=True)
# The plugin imports Ansible, and importing Ansible patches sys.intern for the whole process, which breaks
# torch._dynamo in the parity tests collected beside this file: the plugin runs in a child process instead.
APPLY_PLUGIN = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("pdserve_tokens", sys.argv[1])
plugin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin)
out = []
for key, principal in json.load(sys.stdin):
    try:
        out.append({"token": plugin.pdserve_principal_token(key, principal)})
    except Exception as error:
        out.append({"error": type(error).__name__, "message": str(error)})
json.dump(out, sys.stdout)
"""


def apply_plugin(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The filter's answer for each (key, principal), as Ansible on the controller would compute it."""
    result = subprocess.run(
        [sys.executable, "-c", APPLY_PLUGIN, str(PLUGIN)],
        input=json.dumps(pairs),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    answers: list[dict[str, Any]] = json.loads(result.stdout)
    return answers


@settings(max_examples=4, deadline=None)
@given(pairs=st.lists(st.tuples(KEYS, PRINCIPALS), min_size=1, max_size=40))
def test_filter_equals_the_schedulers_derivation(pairs: list[tuple[str, str]]) -> None:
    for (key, principal), answer in zip(pairs, apply_plugin(pairs), strict=True):
        assert answer["token"] == identity.derive_token(key, principal)
        assert identity.principal_of(key, answer["token"]) == principal


def test_the_key_file_newline_is_not_part_of_the_key() -> None:
    # The scheduler strips its key file; a key written with a trailing newline must derive the same tokens.
    assert apply_plugin([("k3y\n", "gateway")]) == [{"token": identity.derive_token("k3y", "gateway")}]


BAD = [
    ("", "gateway", "identity key is empty"),
    ("k", "instance:decode 1", "1..128 characters of"),
    ("k", "", "1..128 characters of"),
    ("k", "instance:" + "x" * 120, "1..128 characters of"),
    ("k", "admin", "must be 'gateway' or instance:<id>"),
    ("k", "instance:", "must be 'gateway' or instance:<id>"),
]


def test_bad_input_fails_naming_the_problem() -> None:
    answers = apply_plugin([(key, principal) for key, principal, _ in BAD])
    for (_, _, message), answer in zip(BAD, answers, strict=True):
        assert answer["error"].startswith("Ansible") and message in answer["message"], answer  # AnsibleFilterError


@pytest.mark.slow  # ansible-playbook
def test_ansible_finds_the_filter_through_the_role(tmp_path: Path) -> None:
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "derive",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "load the role's plugins",
                            "ansible.builtin.import_role": {"name": "serving_node", "tasks_from": "pinning.yml"},
                        },
                        {
                            "name": "derive",
                            "ansible.builtin.debug": {
                                "msg": "{{ 'k3y' | pdserve_principal_token('instance:decode-node-1-0123abcd') }}"
                            },
                        },
                    ],
                }
            ]
        )
    )
    result = run_local_playbook(playbook, tmp_path, json.dumps({"pdserve_component": "decode"}))
    assert result.returncode == 0, result.output
    assert identity.derive_token("k3y", "instance:decode-node-1-0123abcd") in result.output
