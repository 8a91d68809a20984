"""The user data (cloud-init `#cloud-config`) a GPU pool's instances boot from, rendered from the stack files.

One document per pool of a datacenter stack: infra/ hands it to the pool's launch template, and the local
environment gives the same text to its node containers through cloud-init's NoCloud seed. The two differ only in
the environment's values (node.json), the local one adding `aws_endpoint_url` (its AWS APIs, moto), the cloud one
`ssm_agent` (the SSM agent stage 0 installs, when the stack pins one). It:

- writes /etc/pdstack/node.json (NodeConfig: who the node is and which names to ask for, no secret),
- writes stage 0 (pdstack/node/loader.py's own source, gzip+base64) and a systemd unit that runs it at every boot,
- installs what stage 0 needs from Debian's packages (python3-boto3, python3-venv),
- enables and starts that unit without waiting for it (a model download must not hold up cloud-init).

Everything else (pdstack, ansible-core, the roles) comes from the release's node bundle. EC2 refuses user data over
16 KB (before base64): USER_DATA_LIMIT, which a test holds every example pool to.
"""

from __future__ import annotations

import base64
import gzip
from pathlib import Path
from typing import Any

import yaml

from pdstack.contract.components import (
    LOCAL_AWS_REGION,
    contract,
    release_parameter,
    secret_name,
    tls_secret_name,
)
from pdstack.model import LOCAL_REGION, DatacenterRole, PoolRole, StackConfig
from pdstack.node import loader
from pdstack.node.config import NodeConfig, SsmAgentPin

USER_DATA_LIMIT = 16 * 1024
LOADER_PATH = "/usr/local/lib/pdstack/node_loader.py"
UNIT = "pdstack-node-bootstrap.service"
PACKAGES = ("python3-boto3", "python3-venv")

UNIT_TEXT = f"""\
[Unit]
Description=pdstack node bootstrap: release, secrets, registry, model, roles (pdstack/node)
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
RemainAfterExit=yes
TimeoutStartSec=infinity
ExecStart=/usr/bin/python3 {LOADER_PATH} {loader.NODE_CONFIG}

[Install]
WantedBy=multi-user.target
"""


class UserDataError(ValueError):
    """The stack gives no user data for that pool (a control stack, or no such GPU pool)."""


def api_region(region: str) -> str:
    """The region the AWS APIs are addressed in: the datacenter's, or the local environment's moto region."""
    return LOCAL_AWS_REGION if region == LOCAL_REGION else region


def node_config(
    stack: StackConfig,
    control: StackConfig,
    pool_name: str,
    aws_endpoint_url: str | None,
    ssm_agent: SsmAgentPin | None = None,
) -> NodeConfig:
    """node.json of one pool of `stack`; `control` is the environment's control-plane stack (serving, secrets);
    `ssm_agent` the cloud's pin of the SSM agent (pdstack-infra settings), which stage 0 installs."""
    dc = stack.datacenter
    if dc.role is DatacenterRole.CONTROL or control.serving is None:
        raise UserDataError(f"datacenter {dc.name} is the control plane's: its nodes do not bootstrap themselves")
    pool = next((p for p in dc.pools if p.name == pool_name), None)
    if pool is None or pool.role is PoolRole.CONTROL:
        gpu = ", ".join(p.name for p in dc.pools if p.role is not PoolRole.CONTROL)
        raise UserDataError(f"datacenter {dc.name} has no GPU pool {pool_name!r} (it has: {gpu})")
    env = str(stack.environment)
    return NodeConfig(
        environment=stack.environment,
        datacenter=dc.name,
        region=dc.region,
        aws_region=api_region(dc.region),
        control_region=api_region(control.datacenter.region),
        pool=pool.name,
        role="prefill" if pool.role is PoolRole.PREFILL else "decode",
        release_parameter=release_parameter(env),
        secrets={name: secret_name(env, name) for name in contract(control.serving).node_secrets()},
        tls_secret=tls_secret_name(env, dc.name, pool.name),
        model_dir=control.serving.model.path,
        aws_endpoint_url=aws_endpoint_url,
        ssm_agent=ssm_agent,
    )


def _packed(text: str) -> str:
    return base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so the document reads as the files it writes."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def cloud_config(config: NodeConfig) -> dict[str, Any]:
    return {
        # Debian's image has no locales beyond C.UTF-8; the module would try to generate one (and fails in a
        # container, where none are installed)
        "locale": False,
        "package_update": True,
        "packages": list(PACKAGES),
        "write_files": [
            {"path": str(loader.NODE_CONFIG), "permissions": "0644", "content": config.to_json()},
            {
                "path": LOADER_PATH,
                "permissions": "0755",
                "encoding": "gz+b64",
                "content": _packed(Path(loader.__file__).read_text(encoding="utf-8")),
            },
            {"path": f"/etc/systemd/system/{UNIT}", "permissions": "0644", "content": UNIT_TEXT},
        ],
        # runcmd runs after the packages are in (cloud-init's final stage); the unit then runs at every boot
        "runcmd": ["systemctl daemon-reload", f"systemctl enable {UNIT}", f"systemctl start --no-block {UNIT}"],
    }


def render_user_data(
    stack: StackConfig,
    control: StackConfig,
    pool_name: str,
    aws_endpoint_url: str | None = None,
    ssm_agent: SsmAgentPin | None = None,
) -> str:
    """The `#cloud-config` document of one pool; UserDataError when it would exceed EC2's limit."""
    config = node_config(stack, control, pool_name, aws_endpoint_url, ssm_agent)
    header = (
        f"#cloud-config\n# pdstack node of pool {config.pool}, datacenter {config.datacenter}, environment "
        f"{config.environment}: rendered by pdstack/node/userdata.py from the stack files; do not edit\n"
    )
    text = header + yaml.dump(cloud_config(config), Dumper=_Dumper, sort_keys=False, width=120)
    size = len(text.encode())
    if size > USER_DATA_LIMIT:
        raise UserDataError(f"user data of pool {pool_name} is {size} bytes, over EC2's {USER_DATA_LIMIT}")
    return text
