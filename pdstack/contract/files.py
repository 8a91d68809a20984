"""The deployment contract (pdstack/contract/components.py) as the files its consumers read without the toolkit: the
Ansible variables of each environment (playbooks/vars/contract/<env>.yml) and the policy pack's config
(policy/config/<env>.json), rendered from the environment's stacks; `python -m pdstack.contract.files` writes them
and `--check` says which are out of date."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdstack.contract.alerting import WEBHOOK_CONFIG, alertmanager_config, webhook_receivers
from pdstack.contract.components import (
    PROMETHEUS_URL_PARAMETER_VAR,
    RATELIMIT_STORE_DB,
    SECRETS_DIR,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_DIR,
    TLS_KEY_FILE,
    Component,
    Contract,
    contract,
    prometheus_url_parameter,
)
from pdstack.contract.yamlfiles import dump_yaml
from pdstack.model import Alerting, Environment, Serving
from pdstack.stacks.files import load_stack_file

# -- Ansible ---------------------------------------------------------------------------------------------------------

CONTRACT_VARS_DIR = Path("playbooks") / "vars" / "contract"
HEADER = (
    "# Rendered by `python -m pdstack.contract.files` from stacks/Pulumi.{env}-*.yaml "
    "(pdstack/contract/components.py); do not edit by hand.\n"
)


def ansible_vars(c: Contract) -> dict[str, Any]:
    """The role variables the contract fixes (pdserve, prometheus, node_exporter); playbooks/vars/serving.yml loads
    them for the play's `pdstack_environment`."""
    return {
        "pdserve_components": {
            str(name): {
                "port": comp.port,
                "kv_port": comp.kv_port,
                "health_ready": comp.health_ready,
                "health_live": comp.health_live,
                "env": comp.env(shared_store=True),
                "tls_env": comp.tls_env(),
                "secrets": [
                    {
                        "secret": s.secret,
                        "name": f"pdstack-{s.key}",
                        "target": s.file,
                        "setting": s.variable,
                        **({"principal": s.principal} if s.principal else {}),
                        **({"only_with_shared_store": True} if s.only_with_shared_store else {}),
                    }
                    for s in comp.secrets
                ],
            }
            for name, comp in c.components.items()
        },
        # TLS (#17): where the pdserve role mounts a node's certificate, key and CA, and the settings naming them,
        # used wherever the inventory hands the role TLS files (docs/tls.md)
        "pdserve_tls": {
            "dir": TLS_DIR,
            "cert": TLS_CERT_FILE,
            "key": TLS_KEY_FILE,
            "ca": TLS_CA_FILE,
            "mutual_tls": c.mutual_tls,
        },
        "prometheus_port": c.prometheus.port,
        # a job whose targets require a token: Prometheus' `authorization` block, and the stack secret roles/prometheus
        # puts at its credentials_file (its file under prometheus_secrets_dir, mounted there in the container)
        "prometheus_scrape_groups": [
            {
                "job": g.job,
                "group": g.group,
                "port": g.port,
                **(
                    {
                        "authorization": g.authorization(),
                        "secret": g.credentials.secret,
                        "secret_file": g.credentials.file,
                    }
                    if g.credentials is not None
                    else {}
                ),
            }
            for g in c.scrape_groups
        ],
        "prometheus_secrets_dir": SECRETS_DIR,
        "prometheus_job": c.prometheus.job,
        "prometheus_node_job": c.node_exporter.job,
        "alertmanager_port": c.alertmanager.port,
        "node_exporter_port": c.node_exporter.port,
        "redis_port": c.ratelimit_store.port,
        "pdstack_ratelimit_store_db": RATELIMIT_STORE_DB,
    }


def alerting_vars(env: str, alerting: Alerting | None) -> dict[str, Any]:
    """roles/alertmanager's routing (pdstack/contract/alerting.py) and the stack's webhook: its URL when the stack
    gives it in plain text, else empty (a secret URL reaches Ansible from a vault as pdstack_alert_webhook_url)."""
    url = alerting.webhook_url if alerting is not None and isinstance(alerting.webhook_url, str) else ""
    return {
        "alertmanager_config": alertmanager_config(env),
        "alertmanager_webhook_receivers": webhook_receivers(env),
        "alertmanager_webhook_config": dict(WEBHOOK_CONFIG),
        "alertmanager_webhook_url": url,
    }


def render_ansible_vars(env: str, serving: Serving, alerting: Alerting | None = None) -> str:
    rendered = ansible_vars(contract(serving)) | alerting_vars(env, alerting)
    if env != Environment.LOCAL:  # only the cloud's Prometheus is behind a load balancer whose URL is in SSM
        rendered[PROMETHEUS_URL_PARAMETER_VAR] = prometheus_url_parameter(env)
    return HEADER.format(env=env) + dump_yaml(rendered)


def environment_serving(stacks_dir: Path, env: str) -> Serving:
    """The serving settings of an environment: its control-plane stack's `pdstack:serving`."""
    for path in sorted(stacks_dir.glob(f"Pulumi.{env}-*.yaml")):
        serving = load_stack_file(path).config.serving
        if serving is not None:
            return serving
    raise LookupError(f"no stack of environment {env!r} in {stacks_dir} sets pdstack:serving")


def environment_alerting(stacks_dir: Path, env: str) -> Alerting | None:
    """The alerting settings of an environment: its control-plane stack's `pdstack:alerting`, if any."""
    for path in sorted(stacks_dir.glob(f"Pulumi.{env}-*.yaml")):
        config = load_stack_file(path).config
        if config.serving is not None:
            return config.alerting
    return None


def environments(stacks_dir: Path) -> list[str]:
    return sorted({p.name.removeprefix("Pulumi.").split("-", 1)[0] for p in stacks_dir.glob("Pulumi.*-*.yaml")})


def write_ansible_vars(project: Path, env: str, serving: Serving | None = None) -> bool:
    """Write playbooks/vars/contract/<env>.yml if it differs; True when it changed."""
    stacks = project / "stacks"
    text = render_ansible_vars(env, serving or environment_serving(stacks, env), environment_alerting(stacks, env))
    return bool(sync_files({project / CONTRACT_VARS_DIR / f"{env}.yml": text}))


def sync_files(files: Mapping[Path, str], check: bool = False) -> list[str]:
    """The files whose content differs from `files` (missing ones included), each rewritten unless `check`."""
    stale = []
    for path, text in files.items():
        if not path.is_file() or path.read_text() != text:
            stale.append(str(path))
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return stale


# -- the policy pack -----------------------------------------------------------------------------------------------

POLICY_CONFIG_DIR = Path("policy") / "config"
KV_PORT_POLICY = "kv-port-peers-only"  # policy/rules.py: the rule that reads the KV port from the pack's config


def policy_config(c: Contract) -> dict[str, Any]:
    """The policy pack's config (`pulumi preview --policy-pack policy --policy-pack-config policy/config/<env>.json`):
    the KV ports its rule checks are the ports prefill listens on for KV (kvPort to kvPortLast)."""
    kv = c[Component.PREFILL].kv_ports
    return {KV_PORT_POLICY: {"kvPort": kv.start, "kvPortLast": kv[-1]}}


def render_policy_config(serving: Serving) -> str:
    return json.dumps(policy_config(contract(serving)), indent=2, sort_keys=True) + "\n"


def rendered_files(project: Path, env: str, serving: Serving, alerting: Alerting | None = None) -> dict[Path, str]:
    """Every file the contract renders for one environment."""
    files = {project / CONTRACT_VARS_DIR / f"{env}.yml": render_ansible_vars(env, serving, alerting)}
    if env != Environment.LOCAL:  # the local environment is deployed by Ansible alone, no Pulumi, no policy pack
        files[project / POLICY_CONFIG_DIR / f"{env}.json"] = render_policy_config(serving)
    return files


def all_rendered_files(project: Path) -> dict[Path, str]:
    """Every file the contract renders, for every environment of project's stacks."""
    stacks = project / "stacks"
    return {
        path: text
        for env in environments(stacks)
        for path, text in rendered_files(
            project, env, environment_serving(stacks, env), environment_alerting(stacks, env)
        ).items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdstack.contract.files",
        description="Render playbooks/vars/contract/<env>.yml and policy/config/<env>.json for every environment.",
    )
    parser.add_argument("--project", type=Path, default=Path.cwd())
    parser.add_argument("--check", action="store_true", help="exit 1 if a rendered file is out of date")
    args = parser.parse_args(argv)
    stale = sync_files(all_rendered_files(args.project), args.check)
    for name in stale:
        print(("stale: " if args.check else "wrote: ") + name)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
