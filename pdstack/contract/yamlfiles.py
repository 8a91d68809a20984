"""YAML as the committed files pdstack renders for Ansible are written: lint-clean under ansible-lint's yaml rule."""

from __future__ import annotations

from typing import Any

import yaml


class IndentedDumper(yaml.SafeDumper):
    """Lists indented under their key, as yamllint's indentation rule (ansible-lint's yaml rule) wants; PyYAML's
    default writes them flush with the key."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def dump_yaml(data: Any, width: int = 80) -> str:
    return yaml.dump(data, Dumper=IndentedDumper, sort_keys=False, default_flow_style=False, width=width)
