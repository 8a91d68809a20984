"""What `inventories/aws/` needs from the stacks, rendered into two committed files:

- `pdstack.aws_ec2.yml`, the `amazon.aws.aws_ec2` inventory: the regions every cloud environment's datacenters are in;
  it groups the instances by the `pdstack:*` tags the Pulumi program puts on them (infra/tags.py).
- `group_vars/all/stacks.yml`, per environment: its secrets' Secrets Manager names (each server pool's certificate
  among them), the region holding them (the control plane's), its private zone, the SSM parameters naming the
  scheduler's URL and holding the CA, and per datacenter its region and its widest link (the largest
  bandwidth-delay product, which sizes socket buffers), as `pdstack local` renders them for inventories/local.

`python -m pdstack.contract.cloud_inventory [--stacks DIR]` rewrites both; a test checks that the committed files are
current."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pdstack.contract.components import (
    DNS_DOMAIN,
    ca_certificate_parameter,
    cloud_names,
    operator_tls_secret_name,
    scheduler_url_parameter,
    secret_name,
    tls_secret_name,
)
from pdstack.contract.yamlfiles import dump_yaml
from pdstack.model import DatacenterRole, Link, LinkKind, PoolRole
from pdstack.model import Environment as EnvName
from pdstack.stacks.environment import (
    PROJECT_FILE,
    EnvironmentStacks,
    default_stacks_dir,
    environment_names,
    load_environment,
)

CLOUD_ENVIRONMENTS = tuple(e.value for e in EnvName if e is not EnvName.LOCAL)
# The path MTU across a link (kernel_tuning counts a link's BDP in segments of MTU - 52 bytes, so an MTU set too
# low would send several BDPs in the first flight): AWS Transit Gateway carries 8500-byte packets, VPC peering
# 1500 between regions (9001 within one; 1500 undershoots there, and slow start makes up the rest).
PATH_MTU = {LinkKind.TRANSIT_GATEWAY: 8500, LinkKind.VPC_PEERING: 1500}
# Tag keys (infra/tags.py; a test checks they agree). Kept here so the toolkit does not import the Pulumi program.
ENV_TAG, DC_TAG, ROLE_TAG, POOL_TAG = "pdstack:env", "pdstack:dc", "pdstack:role", "pdstack:pool"
# The control-plane stack's setting of the private zone's domain (infra/environment.py; a test checks it)
DNS_DOMAIN_KEY = "pdstack-infra:dns_domain"
ENV_VARIABLE = "PDSTACK_ENVIRONMENT"  # which environment's instances the inventory lists
SERVING_ROLES = [str(r) for r in PoolRole if r.needs_gpu]  # the pdstack:role values of the hosts Ansible manages
HEADER = (
    "# Rendered by `python -m pdstack.contract.cloud_inventory` from stacks/Pulumi.{dev,staging,prod}-*.yaml; "
    "do not edit.\n"
)


def environments(stacks_dir: Path) -> list[EnvironmentStacks]:
    present = environment_names(stacks_dir)
    return [load_environment(stacks_dir, env) for env in CLOUD_ENVIRONMENTS if env in present]


def other(owner: str, link: Link, name: str) -> str:
    """The datacenter at the far end of `link` (declared by `owner`) from datacenter `name`."""
    return link.peer if owner == name else owner


def stack_vars(envs: list[EnvironmentStacks]) -> dict[str, Any]:
    cloud: dict[str, Any] = {}
    for env in envs:
        datacenters: dict[str, Any] = {}
        links = [(s.config.datacenter.name, link) for s in env.stacks for link in s.config.datacenter.links]
        cidrs = {s.config.datacenter.name: str(s.config.datacenter.cidr) for s in env.stacks}
        for stack in env.stacks:
            dc = stack.config.datacenter
            # by peer: a link declared on both sides alike is one link
            peers = {other(owner, link, dc.name): link for owner, link in links if dc.name in (owner, link.peer)}
            widest = max(peers.values(), key=lambda link: link.bandwidth_gbps * link.rtt_ms, default=None)
            entry: dict[str, Any] = {"region": dc.region}
            if widest is not None:
                entry |= {"link_bandwidth_gbps": widest.bandwidth_gbps, "link_rtt_ms": widest.rtt_ms}
                entry["peer_links"] = [
                    {
                        "cidr": cidrs[peer],
                        "bandwidth_gbps": link.bandwidth_gbps,
                        "rtt_ms": link.rtt_ms,
                        "mtu": PATH_MTU[link.kind],
                    }
                    for peer, link in sorted(peers.items())
                ]
            datacenters[dc.name] = entry
        control = env.control.config
        cloud[env.name] = {
            "secrets_region": control.datacenter.region,
            # Secrets Manager names of the environment's secrets (infra/secrets.py secret_path; a test checks them
            # against the names the program gives its aws.secretsmanager.Secret resources).
            "secrets": {spec.name: secret_name(env.name, spec.name) for spec in control.secret_specs},
            # each server pool's certificate, key and CA (infra/certificates.py), by datacenter and pool
            "tls_secrets": {
                s.config.datacenter.name: {
                    p.name: tls_secret_name(env.name, s.config.datacenter.name, p.name)
                    for p in s.config.datacenter.pools
                }
                for s in env.stacks
                if s.config.datacenter.role is not DatacenterRole.CONTROL
            },
            "datacenters": datacenters,
            # the private zone the instances' own names are in (group_vars/nodes.yml pdstack_instance_name)
            "zone": cloud_names(env.name, env.control.pulumi_config.get(DNS_DOMAIN_KEY) or DNS_DOMAIN).zone,
            # where the control plane stack writes the EKS scheduler's URL and the CA (group_vars/all/control_plane.yml)
            "scheduler_url_parameter": scheduler_url_parameter(env.name),
            "ca_certificate_parameter": ca_certificate_parameter(env.name),
        }
        serving = control.serving
        if serving is not None and serving.mutual_tls:  # the controller presents the operator's certificate
            cloud[env.name]["operator_tls_secret"] = operator_tls_secret_name(env.name)
    return {"pdstack_cloud": cloud}


def plugin_config(envs: list[EnvironmentStacks]) -> dict[str, Any]:
    regions = sorted({s.config.datacenter.region for env in envs for s in env.stacks})
    return {
        "plugin": "amazon.aws.aws_ec2",
        "regions": regions,
        # One environment at a time.
        "filters": {
            f"tag:{ENV_TAG}": (
                f"{{{{ lookup('ansible.builtin.env', '{ENV_VARIABLE}', "
                f"default=undef('set {ENV_VARIABLE} to one of {', '.join(CLOUD_ENVIRONMENTS)}')) }}}}"
            ),
            "instance-state-name": "running",
            # GPU nodes only. The control plane's instances are EKS system nodes: EKS manages them and they run the
            # scheduler and gateway as pods, so no play may take them for its `control` hosts (or baseline them).
            f"tag:{ROLE_TAG}": SERVING_ROLES,
        },
        # <datacenter>-<instance id>: unique, and says where the host is.
        "hostnames": [{"name": "instance-id", "prefix": f"tag:{DC_TAG}", "separator": "-"}],
        # The instance's own attributes as aws_* (aws_tags, aws_private_ip_address, ...): out of the way of the roles'
        # variables (a bare `tags` is a name Ansible reserves).
        "hostvars_prefix": "aws_",
        "compose": {
            # SSH runs through SSM Session Manager (group_vars/nodes.yml): the target is the instance id.
            "ansible_host": "aws_instance_id",
            "pdstack_address": "aws_private_ip_address",
            "pdstack_region": "aws_placement.region",
            "pdstack_environment": f"aws_tags['{ENV_TAG}']",
            "pdstack_datacenter": f"aws_tags['{DC_TAG}']",
            "pdstack_role": f"aws_tags['{ROLE_TAG}']",
            "pdstack_pool": f"aws_tags['{POOL_TAG}']",
        },
        "groups": {"nodes": "true"},
        # By role (prefill, decode: the playbooks' groups; no `control`, the control plane is in EKS), datacenter
        # (dc_<name>), environment (env_<name>);
        # group names keep only letters, digits and `_`, so dc_prefill-us-east-1 becomes dc_prefill_us_east_1.
        "keyed_groups": [
            {"key": f"aws_tags['{ROLE_TAG}']", "prefix": "", "separator": ""},
            {"key": f"aws_tags['{DC_TAG}']", "prefix": "dc"},
            {"key": f"aws_tags['{ENV_TAG}']", "prefix": "env"},
        ],
        "strict": True,
    }


def render(stacks_dir: Path) -> dict[str, str]:
    """The files, by path relative to inventories/aws/."""
    envs = environments(stacks_dir)

    def dump(data: dict[str, Any]) -> str:
        return HEADER + "---\n" + dump_yaml(data, width=150)

    return {"pdstack.aws_ec2.yml": dump(plugin_config(envs)), "group_vars/all/stacks.yml": dump(stack_vars(envs))}


def write(stacks_dir: Path, inventory_dir: Path) -> list[Path]:
    """Write the files that differ; the paths changed."""
    changed = []
    for name, text in render(stacks_dir).items():
        path = inventory_dir / name
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--stacks", type=Path, default=None, help="stacks folder (default: the project's)")
    args = parser.parse_args(argv)
    stacks = args.stacks or default_stacks_dir()
    project = stacks.resolve().parent
    if not (project / PROJECT_FILE).is_file():
        parser.error(f"{stacks} is not beside a {PROJECT_FILE}")
    for path in write(stacks, project / "inventories" / "aws"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
