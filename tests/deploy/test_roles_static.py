"""The roles and playbooks without nodes: the ansible-lint command .ansible-lint documents (every role and playbook,
production profile) finds nothing, bad variables are refused with a message naming them, and models are verified
against a manifest on real files."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.node.apply import VARS_FILE
from pdstack.node.loader import STATE_DIR
from tests.support import REPO
from tests.support.ansible import assert_lint_clean, run_local_playbook

DIGEST_IMAGE = "10.210.255.1:5000/pdstack/pdserve@sha256:" + "ab" * 32
CONTRACT_VARS = REPO / "playbooks" / "vars" / "contract" / "local.yml"  # what playbooks/vars/serving.yml loads


def play(tmp_path: Path, tasks: list[dict[str, object]], variables: dict[str, object]) -> tuple[int, str]:
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [{"name": "test", "hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": tasks}]
        )
    )
    result = run_local_playbook(playbook, tmp_path, f"@{CONTRACT_VARS}", json.dumps(variables))
    return result.returncode, " ".join(result.output.split())


def include(role: str, tasks_from: str = "main") -> list[dict[str, object]]:
    return [{"name": "role", "ansible.builtin.include_role": {"name": role, "tasks_from": tasks_from}}]


def test_the_documented_ansible_lint_finds_nothing(tmp_path: Path) -> None:
    assert_lint_clean(tmp_path)


@pytest.mark.parametrize(
    ("role", "variables", "message"),
    [
        ("pdserve", {"pdserve_component": "router"}, "pdserve_component must be one of"),
        (
            "pdserve",
            {"pdserve_component": "decode", "pdserve_restart_policy": "sometimes"},
            "pdserve_restart_policy must be one of",
        ),
        ("prometheus", {"prometheus_port": "nine"}, "prometheus_port"),
        ("model_artifacts", {}, "missing required arguments: model_artifacts_source"),
        ("redis", {}, "redis_password_file must name a file on the controller"),
        (
            "redis",
            {"redis_password_file": "/nonexistent", "redis_maxmemory_policy": "lru"},
            "redis_maxmemory_policy must be one of",
        ),
        ("redis", {"redis_password_file": "/nonexistent", "redis_port": "six"}, "redis_port"),
    ],
)
def test_bad_variables_are_refused_naming_them(
    tmp_path: Path, role: str, variables: dict[str, object], message: str
) -> None:
    code, output = play(tmp_path, include(role), variables)
    assert code != 0
    assert message in output, output[-3000:]


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        (
            {"pdserve_image": "10.210.255.1:5000/pdstack/pdserve:latest", "pdserve_version": "r1"},
            "pdserve_image must be an image by digest",
        ),
        ({"pdserve_image": DIGEST_IMAGE, "pdserve_version": "release 1"}, "got 'release 1'"),
        ({"pdserve_image": DIGEST_IMAGE, "pdserve_version": "r1"}, "needs pdserve_kv_key_file"),
        (
            {"pdserve_image": DIGEST_IMAGE, "pdserve_version": "r1", "pdserve_kv_key_file": "/k"},
            "needs pdserve_identity_key_file",
        ),
        (
            {
                "pdserve_image": DIGEST_IMAGE,
                "pdserve_version": "r1",
                "pdserve_kv_key_file": "/k",
                "pdserve_identity_key_file": "/i",
            },
            "needs pdserve_server_token_file",
        ),
    ],
)
def test_release_and_secret_checks_name_the_problem(tmp_path: Path, variables: dict[str, object], message: str) -> None:
    code, output = play(tmp_path, include("pdserve"), {"pdserve_component": "decode", **variables})
    assert code != 0
    assert message in output, output[-3000:]


@pytest.mark.parametrize(
    ("joined", "engine_id"),
    [
        ({"pdstack_role": "decode", "pdstack_engine_id": "i-0123456789abcdef0"}, "i-0123456789abcdef0"),
        ({"pdstack_role": "prefill", "pdstack_engine_id": "i-0123456789abcdef0"}, None),  # another server's
        (None, None),  # a node the operators converge: derived from the host and the release
    ],
)
def test_an_operators_play_keeps_the_instance_a_node_joined_as(
    tmp_path: Path, joined: dict[str, str] | None, engine_id: str | None
) -> None:
    """On a node that booted from its user data, the server an operator's play (deploy.yml, rollback.yml) starts
    registers as the instance the node joined as, whose token it holds and whose drain its group's scale-in asks for;
    the file is where the bootstrap writes its variables."""
    vars_file = tmp_path / "apply-vars.json"
    if joined is not None:
        vars_file.write_text(json.dumps(joined))
    out = tmp_path / "facts.json"
    tasks = [
        *include("serving_node", "release"),
        {"name": "facts", "ansible.builtin.copy": {"dest": str(out), "content": "{{ serving_node_engine_id }}"}},
    ]
    variables = {
        "serving_node_component": "decode",
        "serving_node_state_dir": str(tmp_path / "state"),
        "serving_node_new_release": {"image": DIGEST_IMAGE, "version": "r2", "config_version": "2"},
        "serving_node_joined_vars_file": str(vars_file),
    }
    code, output = play(tmp_path, tasks, variables)
    assert code == 0, output[-3000:]
    assert out.read_text() == (engine_id or f"localhost-{hashlib.sha1(b'r2/2').hexdigest()[:8]}")
    role = REPO / "roles" / "serving_node"
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    spec = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]["release"]["options"]
    assert defaults["serving_node_joined_vars_file"] == str(STATE_DIR / VARS_FILE)
    assert spec["serving_node_joined_vars_file"]["default"] == str(STATE_DIR / VARS_FILE)


SECRET_FILES = {
    "pdserve_kv_key_file": "/s/kv",
    "pdserve_admin_token_file": "/s/admin",
    "pdserve_identity_key_file": "/s/identity",
    "pdserve_server_token_file": "/s/server",
    "pdserve_api_keys_file": "/s/keys",
    "pdserve_rate_limit_password_file": "/s/redis",
    "pdserve_metrics_token_file": "/s/metrics",
    "pdserve_rate_limit_storage": "redis://10.210.0.10:6379/0",
}
SERVER_ENV = {
    "PDSERVE_SCHEDULER_TOKEN_FILE": "/run/secrets/scheduler.token",
    "PDSERVE_API_TOKEN_FILE": "/run/secrets/server.token",
}


def rendered(tmp_path: Path, component: str) -> dict[str, object]:
    """The role's environment and secret list for `component`, from its defaults and vars as the role loads them."""
    out = tmp_path / f"{component}.json"
    task = {
        "name": "render",
        "ansible.builtin.copy": {
            "dest": str(out),
            "mode": "0600",
            "content": "{{ {'env': pdserve__environment, 'secrets': pdserve__secrets} | to_json }}",
        },
    }
    playbook = tmp_path / "render.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "render",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "vars_files": [
                        str(REPO / "roles/pdserve/defaults/main.yml"),
                        str(REPO / "roles/pdserve/vars/main.yml"),
                        str(CONTRACT_VARS),
                    ],
                    "tasks": [task],
                }
            ]
        )
    )
    variables = {
        **SECRET_FILES,
        "pdserve_component": component,
        "pdserve__engine_id": "node-1-0123abcd",
        "serving_node_release": {"image": DIGEST_IMAGE, "version": "r1", "config_version": "1"},
    }
    result = run_local_playbook(playbook, tmp_path, json.dumps(variables))
    assert result.returncode == 0, result.output
    found: dict[str, object] = json.loads(out.read_text())
    return found


@pytest.mark.parametrize(
    ("component", "env", "secrets"),
    [
        (
            "scheduler",
            {
                "PDSERVE_ADMIN_TOKEN_FILE": "/run/secrets/admin.token",
                "PDSERVE_IDENTITY_KEY_FILE": "/run/secrets/identity.key",
            },
            {("scheduler-admin-token", "admin.token", None), ("scheduler-identity-key", "identity.key", None)},
        ),
        (
            "decode",
            {**SERVER_ENV, "PDSERVE_KV_KEY_FILE": "/run/secrets/kv.key"},
            {
                ("kv-channel-key", "kv.key", None),
                ("scheduler-identity-key", "scheduler.token", "instance"),
                ("server-api-token", "server.token", None),
            },
        ),
        (
            "prefill",
            {**SERVER_ENV, "PDSERVE_KV_KEY_FILE": "/run/secrets/kv.key"},
            {
                ("kv-channel-key", "kv.key", None),
                ("scheduler-identity-key", "scheduler.token", "instance"),
                ("server-api-token", "server.token", None),
            },
        ),
        (
            "colocated",
            SERVER_ENV,
            {("scheduler-identity-key", "scheduler.token", "instance"), ("server-api-token", "server.token", None)},
        ),
        (
            "gateway",
            {
                "PDSERVE_API_KEYS_FILE": "/run/secrets/api-keys.json",
                "PDSERVE_SCHEDULER_TOKEN_FILE": "/run/secrets/scheduler.token",
                "PDSERVE_SERVER_TOKEN_FILE": "/run/secrets/server.token",
                "PDSERVE_RATE_LIMIT_STORAGE": "redis://10.210.0.10:6379/0",
                "PDSERVE_RATE_LIMIT_PASSWORD_FILE": "/run/secrets/ratelimit.password",
                "PDSERVE_METRICS_TOKEN_FILE": "/run/secrets/metrics.token",
            },
            {
                ("gateway-api-keys", "api-keys.json", None),
                ("scheduler-identity-key", "scheduler.token", "gateway"),
                ("server-api-token", "server.token", None),
                ("ratelimit-store-password", "ratelimit.password", None),
                ("metrics-scrape-token", "metrics.token", None),
            },
        ),
    ],
)
def test_each_component_gets_the_contracts_settings_and_only_its_own_credentials(
    tmp_path: Path, component: str, env: dict[str, str], secrets: set[tuple[str, str, str | None]]
) -> None:
    found = rendered(tmp_path, component)
    environment = found["env"]
    assert isinstance(environment, dict) and isinstance(found["secrets"], list)
    assert env.items() <= environment.items(), environment
    assert not any("INSTANCE_TOKEN" in name for name in environment)
    # Only the scheduler gets the identity key itself; everyone else a token derived for one principal.
    assert {(s["secret"], s["target"], s.get("principal")) for s in found["secrets"]} == secrets


def test_prometheus_needs_an_image_by_digest(tmp_path: Path) -> None:
    code, output = play(tmp_path, include("prometheus"), {"prometheus_image": "localhost/prometheus:latest"})
    assert code != 0 and "prometheus_image must be an image by digest" in output


def test_prometheus_needs_the_file_of_the_gateways_metrics_token(tmp_path: Path) -> None:
    """The contract's gateway job presents metrics-scrape-token: without its file the role stops before it writes
    a thing (else Prometheus would scrape the gateway into 401s)."""
    code, output = play(tmp_path, include("prometheus"), {"prometheus_image": DIGEST_IMAGE})
    assert code != 0
    assert "the pdserve-gateway job presents the metrics-scrape-token secret; give its file" in output, output[-3000:]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    source = tmp_path / "model"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (source / "sub" / "tokenizer.json").write_text("{}")
    sums = subprocess.run(
        ["sha256sum", "config.json", "model.safetensors", "sub/tokenizer.json"],
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (source / "SHA256SUMS").write_text(sums)
    return source


def test_model_is_copied_and_verified_then_a_changed_file_is_named(tmp_path: Path, model: Path) -> None:
    dest = tmp_path / "node" / "models" / "tiny"
    code, output = play(
        tmp_path, include("model_artifacts"), {"model_artifacts_source": str(model), "model_artifacts_dest": str(dest)}
    )
    assert code == 0, output[-3000:]
    assert (dest / "sub" / "tokenizer.json").read_text() == "{}"
    assert "3 files match the manifest" in output
    (dest / "model.safetensors").write_bytes(b"tampered")
    (dest / "sub" / "tokenizer.json").unlink()
    verify = {"model_artifacts_dest": str(dest), "model_artifacts_node_manifest": str(dest / "SHA256SUMS")}
    code, output = play(tmp_path, include("model_artifacts", "verify"), verify)
    assert code != 0
    assert "2 file(s)" in output and "model.safetensors: sha256" in output and "sub/tokenizer.json: missing" in output


def test_a_malformed_manifest_line_is_named(tmp_path: Path, model: Path) -> None:
    (model / "SHA256SUMS").write_text("not-a-hash  config.json\n")
    code, output = play(
        tmp_path,
        include("model_artifacts"),
        {"model_artifacts_source": str(model), "model_artifacts_dest": str(tmp_path / "dest")},
    )
    assert code != 0 and "line 'not-a-hash config.json' is not" in output.replace("  ", " ")


def test_a_manifest_path_leaving_the_model_folder_is_refused(tmp_path: Path, model: Path) -> None:
    (model / "SHA256SUMS").write_text("ab" * 32 + "  ../../etc/passwd\n")
    code, output = play(
        tmp_path,
        include("model_artifacts"),
        {"model_artifacts_source": str(model), "model_artifacts_dest": str(tmp_path / "dest")},
    )
    assert code != 0 and "../../etc/passwd" in output


def test_a_gateway_without_a_shared_store_gets_no_store_password(tmp_path: Path) -> None:
    global SECRET_FILES  # noqa: PLW0603 (one variation of the module's settings, restored below)
    saved = SECRET_FILES
    SECRET_FILES = {k: v for k, v in saved.items() if k != "pdserve_rate_limit_password_file"}
    try:
        found = rendered(tmp_path, "gateway")
    finally:
        SECRET_FILES = saved
    environment, secrets = found["env"], found["secrets"]
    assert isinstance(environment, dict) and isinstance(secrets, list)
    assert "PDSERVE_RATE_LIMIT_PASSWORD_FILE" not in environment
    assert "ratelimit-store-password" not in {s["secret"] for s in secrets}


FAMILY_OF = {"Debian": "Debian", "Ubuntu": "Debian", "Amazon": "RedHat", "RedHat": "RedHat", "Rocky": "RedHat"}


def test_per_os_vars_exist_only_where_they_differ_from_their_familys() -> None:
    """A role loads vars/<distribution>-<major>.yml, else vars/<os_family>.yml (first_found): a version file equal
    to its family's fallback only doubles what a change must touch."""
    copies = []
    for version_file in REPO.glob("roles/*/vars/*-*.yml"):
        family = version_file.parent / f"{FAMILY_OF[version_file.stem.split('-')[0]]}.yml"
        assert family.exists(), f"{version_file} has no fallback {family.name}"
        if version_file.read_text() == family.read_text():
            copies.append(str(version_file.relative_to(REPO)))
    assert copies == []


ROLES = sorted(p.parent.name for p in REPO.glob("roles/*/tasks"))


def role_tasks(node: object) -> list[dict[str, Any]]:
    """Every task of a task file, those in blocks too."""
    if isinstance(node, list):
        return [t for item in node for t in role_tasks(item)]
    if not isinstance(node, dict):
        return []
    return [node] + [t for key in ("block", "rescue", "always") for t in role_tasks(node.get(key, []))]


def test_roles_stand_alone() -> None:
    """No role reads another role's private (`<role>__*`) variables, and a role runs another role's tasks only
    through an entry point that role's meta/argument_specs.yml declares (typed arguments, documented results):
    pdserve and vllm_engine share roles/serving_node's, not each other's files."""
    private, includes = set(), []
    for role in ROLES:
        for path in sorted((REPO / "roles" / role).rglob("*.yml")):
            text = path.read_text()
            private |= {(role, m) for m in re.findall(r"\b([a-z][a-z0-9_]*?)__[a-z0-9_]+", text) if m in ROLES}
            if "tasks" not in path.relative_to(REPO / "roles" / role).parts:
                continue
            for task in role_tasks(yaml.safe_load(text)):
                for key in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
                    if key in task and task[key]["name"] != role:
                        includes.append((role, task[key]["name"], Path(task[key].get("tasks_from", "main")).stem))
    assert {(role, other) for role, other in private if other != role} == set()
    specs = {
        role: set(yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"])
        for role in ROLES
        if (REPO / "roles" / role / "meta" / "argument_specs.yml").exists()
    }
    assert [i for i in includes if i[2] not in specs.get(i[1], set())] == []
    assert {(role, other) for role, other, _ in includes if {role, other} == {"pdserve", "vllm_engine"}} == set()
    assert {("pdserve", "serving_node"), ("vllm_engine", "serving_node")} <= {(r, o) for r, o, _ in includes}


# What serving_node's entry points leave as facts (its README's results): its callers read these and nothing else.
RESULTS = {
    "serving_node_release",
    "serving_node_record_after",
    "serving_node_engine_id",
    "serving_node_instance_id",
    "serving_node_secret_mounts",
    "serving_node_pinned_cpus",
    "serving_node_pinned_mems",
}


def test_serving_node_documents_every_entry_point_and_argument() -> None:
    """Each task file of roles/serving_node is an entry point with every serving_node_* variable it uses typed and
    described, and every argument has its default in defaults/main.yml or is required."""
    role = REPO / "roles" / "serving_node"
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    defaults = yaml.safe_load((role / "defaults" / "main.yml").read_text())
    assert set(specs) == {p.stem for p in (role / "tasks").glob("*.yml")}
    private_vars = yaml.safe_load((role / "vars" / "main.yml").read_text())
    for entry, spec in specs.items():
        options = spec["options"]
        assert all(o["type"] and o["description"] for o in options.values()), entry
        assert all(o.get("required") or name in defaults for name, o in options.items()), entry
        text = (role / "tasks" / f"{entry}.yml").read_text()
        seen: set[str] = set()
        private = set(re.findall(r"\bserving_node__[a-z0-9_]+", text))
        while private - seen:  # the role's vars/main.yml the entry point's tasks use, and those they use
            name = sorted(private - seen)[0]
            seen.add(name)
            text += str(private_vars.get(name, ""))
            private |= set(re.findall(r"\bserving_node__[a-z0-9_]+", str(private_vars.get(name, ""))))
        used = set(re.findall(r"\bserving_node_[a-z0-9_]+", text)) - {n.rstrip("_") for n in private}
        assert used - RESULTS - set(options) == set(), entry
