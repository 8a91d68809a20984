"""playbooks/node.yml, what a node applies to itself, checked without a node: its syntax, from the bundle as a node
unpacks it (roles and collections only from the bundle); the variables apply.py gives cover every required argument
of every role it calls, and what the play and the vars files it loads make of them passes each role's own argument
spec (ansible's validate_argument_spec, rendered for a prod decode node and a local one, the scheduler's URL read from
a moto SSM); and a server's scheduler token, which no node may derive, fails the play naming it unless the
bootstrap's join phase gave it."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.node.apply import extra_vars, playbook_run
from pdstack.node.bundle import PLAYBOOK, build_bundle
from pdstack.node.config import NodeConfig
from pdstack.node.drain import DRAIN_PLAYBOOK
from pdstack.node.join import Joined
from pdstack.node.release import ModelFile, ModelRelease, NodeBundle, ReleaseRecord
from pdstack.node.secrets import SecretFiles
from pdstack.node.userdata import node_config
from pdstack.stacks.environment import load_environment
from tests.support import REPO, STACKS
from tests.support.ansible import ANSIBLE_PLAYBOOK, PlaybookRun
from tests.support.motoserver import CREDENTIALS, client

DIGEST = "sha256:" + "cd" * 32
SCHEDULER_URL = "https://scheduler.internal.example:8100"
_LOCAL = load_environment(STACKS, "local")
LOCAL = node_config(_LOCAL.stack("local-dc2").config, _LOCAL.control.config, "decode", None)
NODES = {"prod": ("prod-decode-us-west-2", "decode-h200"), "local": ("local-dc2", "decode")}


def node_playbook() -> list[dict[str, Any]]:
    return list(yaml.safe_load((REPO / PLAYBOOK).read_text()))


def role_entries() -> list[tuple[int, dict[str, Any]]]:
    """(play index, the role's entry) of every role node.yml calls."""
    return [(i, entry) for i, play in enumerate(node_playbook()) for entry in play.get("roles", [])]


def argument_spec(role: str) -> dict[str, Any]:
    specs = yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())
    return dict(specs["argument_specs"]["main"]["options"])


def vars_file_keys(play: dict[str, Any], env: str = "prod") -> set[str]:
    """The variables the play's vars files define."""
    keys: set[str] = set()
    for entry in play["vars_files"]:
        # a list is the first of its files that exists: the environment's platform file, else the cloud's
        name = entry if isinstance(entry, str) else platform_file(env)
        keys |= set(yaml.safe_load((REPO / "playbooks" / name).read_text()))
    return keys


def platform_file(env: str) -> str:
    local = REPO / "playbooks" / "vars" / "platform" / f"{env}.yml"
    return f"vars/platform/{env}.yml" if local.is_file() else "vars/platform/cloud.yml"


def set_fact_keys(play: dict[str, Any]) -> set[str]:
    return {k for task in play.get("pre_tasks", []) for k in task.get("ansible.builtin.set_fact", {})}


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle without its wheels (the play needs none), unpacked as the loader unpacks it."""
    import tarfile  # noqa: PLC0415

    out = tmp_path_factory.mktemp("bundle")
    built = build_bundle(REPO, "prod", out, wheels=False)
    target = out / built.sha256
    with tarfile.open(built.path) as tar:
        tar.extractall(target, filter="data")
    # the local environment's rendered values beside prod's (a local bundle carries them instead)
    for folder in ("contract", "vllm", "platform"):
        (target / "playbooks" / "vars" / folder / "local.yml").write_bytes(
            (REPO / "playbooks" / "vars" / folder / "local.yml").read_bytes()
        )
    return target


def config_of(env: str, moto: str) -> NodeConfig:
    stack, pool = NODES[env]
    environment = load_environment(STACKS, env)
    return node_config(environment.stack(stack).config, environment.control.config, pool, moto)


def release_record(config: NodeConfig, bundle_sha256: str = "0" * 64) -> ReleaseRecord:
    registry = f"123456789012.dkr.ecr.{config.control_region}.amazonaws.com/pdstack-{config.environment}"
    return ReleaseRecord(
        environment=config.environment,
        release="2026-12-07.1",
        images={
            "prefill": f"{registry}/prefill@{DIGEST}",
            "decode": f"{registry}/decode@{DIGEST}",
            "vllm": f"{registry}/vllm@{DIGEST}",
        },
        model=ModelRelease(
            name="m", revision="r", prefix="models/m/r/", files=(ModelFile(path="a", size=0, sha256="0" * 64),)
        ),
        bundle=NodeBundle(key="bundles/x.tar.gz", sha256=bundle_sha256),
        buckets={config.datacenter: "bucket"},
    )


def apply_vars(config: NodeConfig, secrets_dir: Path) -> dict[str, Any]:
    """What apply.py gives the play of a node of `config` (its secrets as files under secrets_dir)."""
    record = release_record(config, hashlib.sha256(b"x").hexdigest())
    secrets_dir.mkdir(parents=True, exist_ok=True)
    files = SecretFiles(
        secrets={name: secrets_dir / name for name in config.secrets},
        tls={name: secrets_dir / name for name in ("tls.crt", "tls.key", "ca.crt")},
    )
    for path in [*files.secrets.values(), *files.tls.values()]:
        path.write_text(f"value of {path.name}\n")
    token = secrets_dir / "scheduler.token"
    token.write_text("pds1.joined-token\n")
    joined = Joined(token, "i-0123456789abcdef0", f"{config.role}-i-0123456789abcdef0")
    return extra_vars(config, "i-0123456789abcdef0", record, files, secrets_dir / "auth.json", joined=joined)


def run_in_bundle(bundle_dir: Path, playbook: Path, home: Path, variables: dict[str, Any], *args: str) -> PlaybookRun:
    """The play as apply.py runs it on a node (its very command: the bundle's ansible.cfg, roles and collections,
    connection local, the variables as a file), with `args` added; HOME is `home`, the AWS credentials moto's."""
    vars_file = home / "apply-vars.json"
    vars_file.write_text(json.dumps(variables))
    record = release_record(LOCAL, bundle_dir.name)
    run = playbook_run(bundle_dir, record.bundle.playbook, vars_file, Path(ANSIBLE_PLAYBOOK).parent)
    argv = [*run.argv[:-1], str(playbook), *args, "-e", "ansible_python_interpreter=/usr/bin/python3"]
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1", "HOME": str(home), **run.env}
    env |= {
        "AWS_ACCESS_KEY_ID": CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": CREDENTIALS["aws_secret_access_key"],
    }
    result = subprocess.run(argv, capture_output=True, text=True, cwd=run.cwd, env=env, check=False)
    return PlaybookRun(result.returncode, result.stdout + result.stderr)


def test_every_required_argument_is_given() -> None:
    """Each role's required arguments: a role parameter in node.yml, a variable of the vars files it loads, a fact
    it sets or an extra var apply.py passes."""
    given_by_apply = set(apply_vars_keys())
    for index, entry in role_entries():
        play = node_playbook()[index]
        given = set(entry) | vars_file_keys(play) | set_fact_keys(play) | given_by_apply
        required = [name for name, option in argument_spec(entry["role"]).items() if option.get("required")]
        assert not [name for name in required if name not in given], entry["role"]


def apply_vars_keys() -> list[str]:
    joined = Joined(Path("/scheduler.token"), "i-0", "decode-i-0")
    return list(extra_vars(LOCAL, "i-0", release_record(LOCAL), SecretFiles({}, {}), Path("/auth.json"), joined=joined))


def test_the_bundle_has_the_collections_the_roles_use() -> None:
    from pdstack.node.bundle import COLLECTIONS  # noqa: PLC0415

    text = "\n".join(
        p.read_text() for p in [*REPO.glob("roles/**/*.yml"), REPO / PLAYBOOK, *REPO.glob("playbooks/vars/node.yml")]
    )
    import re  # noqa: PLC0415

    used = set(
        re.findall(r"\b(containers\.podman|community\.\w+|ansible\.posix|ansible\.utils|amazon\.aws)\.\w+", text)
    )
    assert used <= set(COLLECTIONS)


@pytest.mark.parametrize("playbook", [PLAYBOOK, DRAIN_PLAYBOOK])
def test_syntax(playbook: str, bundle_dir: Path, tmp_path: Path) -> None:
    """The bootstrap's play and the drain's (pdstack node drain), from the bundle alone."""
    run = run_in_bundle(bundle_dir, bundle_dir / playbook, tmp_path, {}, "--syntax-check")
    assert run.returncode == 0, run.output


@pytest.mark.parametrize("env", sorted(NODES))
def test_each_role_takes_what_the_node_gives(env: str, bundle_dir: Path, moto: str, tmp_path: Path) -> None:
    """For each play of node.yml, a play with its hosts, vars files and facts validates every role's arguments as
    node.yml and the vars files make them from apply.py's variables (validate_argument_spec: types, choices, and
    every template rendering: the secrets read from their files, the scheduler's URL from SSM)."""
    config = config_of(env, moto)
    client(moto, "ssm", config.control_region).put_parameter(
        Name=f"/pdstack/{env}/scheduler-url", Value=SCHEDULER_URL, Type="String", Overwrite=True
    )
    variables = apply_vars(config, tmp_path / "secrets")
    plays = []
    for index, play in enumerate(node_playbook()):
        defined = vars_file_keys(play, env) | set(variables)
        checks = []
        for entry in play.get("roles", []):
            spec = argument_spec(entry["role"])
            params = {k: v for k, v in entry.items() if k not in ("role", "when", "tags")}
            provided = {name: f"{{{{ {name} }}}}" for name in spec if name in defined or name in params}
            # a fact set only in a cloud environment: the role's default elsewhere
            provided |= {name: f"{{{{ {name} | default(omit) }}}}" for name in spec if name in set_fact_keys(play)}
            checks.append(
                {
                    "name": f"{entry['role']} takes its arguments",
                    "ansible.builtin.validate_argument_spec": {"argument_spec": spec, "provided_arguments": provided},
                    "vars": params,
                    "no_log": False,
                }
            )
        checks.append(
            {
                "name": "Say what the mapping made",
                "ansible.builtin.debug": {
                    "msg": "{{ {'scheduler': pdstack_scheduler_url | trim, 'address': pdserve_address | trim, "
                    "'release': pdstack_release, 'time_sync_aws': time_sync_aws, "
                    "'bandwidth': kernel_tuning_link_bandwidth_gbps | default('role default')} | to_json }}"
                },
            }
        )
        facts = [task for task in play.get("pre_tasks", []) if "ansible.builtin.set_fact" in task]
        plays.append(
            {
                **{k: play[k] for k in ("hosts", "connection", "gather_facts", "vars_files")},
                "name": f"play {index}",
                "pre_tasks": facts,
                "tasks": checks,
            }
        )
    check = bundle_dir / "playbooks" / f"mapping-{env}.yml"
    check.write_text(yaml.safe_dump(plays, sort_keys=False))
    run = run_in_bundle(bundle_dir, check, tmp_path, variables)
    assert run.returncode == 0, run.output
    assert run.recap("localhost")["failed"] == 0
    assert SCHEDULER_URL in run.output, run.output
    if env == "local":  # the local platform's link (dc2's: 1 Gbit/s), as the inventory gives its converged nodes
        assert '"bandwidth": 1.0}' in run.output, run.output
    if env == "prod":  # the instance's name in the private zone, the Time Sync Service, the datacenter's link
        assert "i-0123456789abcdef0.decode-h200.decode-us-west-2.prod.pdstack.internal" in run.output
        assert '\\"time_sync_aws\\": true' in run.output or "time_sync_aws" in run.output


def test_a_server_without_its_scheduler_token_fails_naming_it(bundle_dir: Path, moto: str, tmp_path: Path) -> None:
    config = config_of("local", moto)
    variables = apply_vars(config, tmp_path / "s")
    variables["pdstack_instance_token_file"] = ""  # a bootstrap that did not join
    run = run_in_bundle(bundle_dir, bundle_dir / PLAYBOOK, tmp_path, variables, "--tags", "always")
    assert run.returncode != 0
    assert "needs its scheduler token for principal instance:decode-<engine id>" in run.output, run.output
    assert "derived from the stack secret scheduler-identity-key, which a node must not read" in run.output
    assert "the bootstrap's join phase gives a node its own (pdstack_instance_token_file)" in run.output


def test_a_server_with_the_token_it_joined_for_passes_the_check(bundle_dir: Path, moto: str, tmp_path: Path) -> None:
    config = config_of("local", moto)
    variables = apply_vars(config, tmp_path / "s")
    run = run_in_bundle(bundle_dir, bundle_dir / PLAYBOOK, tmp_path, variables, "--tags", "always")
    assert run.returncode == 0, run.output
    assert run.recap("localhost")["failed"] == 0
