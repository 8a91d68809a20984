"""Ansible's linear strategy run over Mitogen (ansible.cfg: `strategy = mitogen_linear`).

Mitogen keeps one Python interpreter per host for the whole run and sends it each task's module, where plain Ansible
starts a new interpreter on the host and unpacks and compiles the module and its module_utils for every task. Task
order and results are the linear strategy's. This file only makes the installed package's strategy (pyproject's
`ansible` extra pins mitogen) findable from `strategy_plugins`, here and in the node bundle, whatever the Python
version's site-packages path. `ANSIBLE_STRATEGY=linear` runs a playbook without it.
"""

from ansible_mitogen.plugins.strategy.mitogen_linear import StrategyModule

__all__ = ["StrategyModule"]
