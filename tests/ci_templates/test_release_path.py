"""The release path the stage template drives: site.yml installs the serving containers only where none runs yet
(a first install) and otherwise applies the baseline alone; every release goes through deploy.yml, which succeeds
without touching anything when the release is already the baseline. The decisions' own plays, taken from the
playbooks, run on this machine against nodes that are local directories (their release records in a temporary state
dir); the plays that would restart servers or move weights are stand-ins that only leave a mark when they run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO

BIN = Path(sys.executable).parent
PLAYBOOKS = REPO / "playbooks"


def plays(name: str) -> list[dict[str, Any]]:
    loaded = yaml.safe_load((PLAYBOOKS / name).read_text())
    assert isinstance(loaded, list)
    return loaded


def play(name: str, title: str) -> dict[str, Any]:
    return next(p for p in plays(name) if p.get("name") == title)


def local_play(source: dict[str, Any], extra_vars: dict[str, Any]) -> dict[str, Any]:
    """A play as the playbook has it, minus what needs the environment (vars_files, become)."""
    copy = {k: v for k, v in source.items() if k not in ("vars_files", "become")}
    copy["vars"] = {**copy.get("vars", {}), **extra_vars}
    return copy


def inventory(tmp_path: Path, groups: dict[str, list[str]]) -> Path:
    hosts = {h for members in groups.values() for h in members}
    data = {
        "all": {
            "hosts": {h: {"ansible_connection": "local", "ansible_python_interpreter": sys.executable} for h in hosts},
            "children": {g: {"hosts": dict.fromkeys(members)} for g, members in groups.items()},
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def record(state: Path, component: str, version: str) -> None:
    state.mkdir(parents=True, exist_ok=True)
    (state / f"{component}.release.json").write_text(json.dumps({"current": {"version": version}}))


def run(
    tmp_path: Path, hosts: Path, body: list[dict[str, Any]], extra: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump(body, sort_keys=False))
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(hosts), str(playbook), "-e", json.dumps(extra)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


SERVERS = {"prefill": ["prefill-a", "prefill-b"], "decode": ["decode-a", "decode-b"]}
COMPONENT = "{{ 'prefill' if inventory_hostname in groups['prefill'] else 'decode' }}"


# site.yml ------------------------------------------------------------------------------------------------------------


def test_site_imports_serving_only_on_the_decision_of_a_first_install() -> None:
    site = plays("site.yml")
    assert site[0]["ansible.builtin.import_playbook"] == "baseline.yml" and "when" not in site[0]
    (serving,) = [p for p in site if p.get("ansible.builtin.import_playbook") == "serving.yml"]
    assert serving["when"] == "hostvars['localhost']['site__install_serving'] | bool"
    assert site.index(serving) == len(site) - 1  # after the decision


def site_decision(tmp_path: Path, records: dict[str, str], extra: dict[str, Any]) -> tuple[bool, str]:
    state = tmp_path / "state"
    for host, version in records.items():
        record(state / host, "prefill" if host.startswith("prefill") else "decode", version)
    hosts = inventory(tmp_path, SERVERS)
    find = local_play(
        play("site.yml", "Find the releases the serving nodes run"),
        {"site__state_dir": str(state / "{{ inventory_hostname }}"), "pdstack_server_component": COMPONENT},
    )
    decide = local_play(play("site.yml", "Decide whether this run installs the serving containers"), {})
    report = tmp_path / "decision.json"
    keep = {
        "name": "Report",
        "hosts": "localhost",
        "gather_facts": False,
        "tasks": [
            {
                "ansible.builtin.copy": {
                    "content": "{{ hostvars['localhost']['site__install_serving'] | bool | to_json }}",
                    "dest": str(report),
                    "mode": "0600",
                }
            }
        ],
    }
    done = run(tmp_path, hosts, [find, decide, keep], {"pdstack_release": {"version": "r2"}, **extra})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return json.loads(report.read_text()), done.stdout


def test_site_installs_serving_where_no_server_runs_yet(tmp_path: Path) -> None:
    install, _ = site_decision(tmp_path, {}, {"pdstack_environment": "dev"})
    assert install is True


def test_site_leaves_a_running_fleet_to_the_canary_and_says_so(tmp_path: Path) -> None:
    install, out = site_decision(tmp_path, {"decode-b": "r1"}, {"pdstack_environment": "prod"})
    assert install is False
    assert "baseline only, no serving node replaced and no weight moved" in out
    assert "release r2 with playbooks/deploy.yml" in out


@pytest.mark.parametrize(
    "extra", [{"pdstack_environment": "local"}, {"pdstack_environment": "dev", "pdstack_site_serving": "always"}]
)
def test_site_converges_the_local_environment_or_on_request(tmp_path: Path, extra: dict[str, Any]) -> None:
    install, _ = site_decision(tmp_path, {"prefill-a": "r1", "decode-a": "r1"}, extra)
    assert install is True


# deploy.yml ----------------------------------------------------------------------------------------------------------

FIRST_ACTING_PLAY = "Give the canary's version no traffic before it registers"


def test_every_play_after_the_decision_does_nothing_on_a_no_op() -> None:
    deploy = plays("deploy.yml")
    start = next(i for i, p in enumerate(deploy) if p.get("name") == FIRST_ACTING_PLAY)
    guard = "hostvars['localhost']['deploy__noop'] | bool"
    for p in deploy[start:]:
        first = p["tasks"][0]
        if p["name"] == "Analyse the canary":  # one block (its first task is the golden check tests/inventories take)
            assert first["when"] == f"not ({guard})", p["name"]
        else:
            assert first.get("ansible.builtin.meta") == "end_play" and first["when"] == guard, p["name"]


def deploy_run(
    tmp_path: Path, records: dict[str, str], decode: list[str] | None = None
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The baseline's plays of deploy.yml, then every later play with its no-op guard and a mark in place of its
    work (the Analyse play's block, whose condition carries the guard, likewise)."""
    state, marks = tmp_path / "state", tmp_path / "marks"
    marks.mkdir()
    for host, version in records.items():
        record(state / host, "prefill" if host.startswith("prefill") else "decode", version)
    decode = decode or SERVERS["decode"]
    groups = {
        "prefill": SERVERS["prefill"],
        "decode": decode,
        "canary": ["prefill-a", decode[0]],
        "promote": ["prefill-b", *decode[1:]],
    }
    hosts = inventory(tmp_path, groups)
    deploy = plays("deploy.yml")
    find = local_play(
        play("deploy.yml", "Find the baseline release on the canary nodes"),
        {"deploy__state_dir": str(state / "{{ inventory_hostname }}"), "pdstack_server_component": COMPONENT},
    )
    decide = local_play(play("deploy.yml", "Decide whether the release is already the baseline"), {})
    body = [find, decide]
    start = next(i for i, p in enumerate(deploy) if p.get("name") == FIRST_ACTING_PLAY)
    for i, p in enumerate(deploy[start:]):
        first = dict(p["tasks"][0])
        mark = {
            "name": "Mark",
            "ansible.builtin.copy": {
                "content": "",
                "dest": f"{marks}/{i}-{{{{ inventory_hostname }}}}",
                "mode": "0600",
            },
        }
        analyse = [{"name": "Analyse", "when": first.get("when"), "block": [mark]}]
        tasks = analyse if "block" in first else [first, mark]
        body.append({"name": p["name"], "hosts": p["hosts"], "gather_facts": False, "tasks": tasks})
    done = run(tmp_path, hosts, body, {"pdserve_canary_version": "r2"})
    return done, sorted(m.name for m in marks.iterdir())


def test_a_release_equal_to_the_baseline_is_a_no_op_that_succeeds(tmp_path: Path) -> None:
    done, marks = deploy_run(tmp_path, {"prefill-a": "r2", "decode-a": "r2"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert marks == []  # no weight moved, no node restarted, nothing promoted
    assert "release r2 is already the baseline on the canary nodes (prefill-a, decode-a): nothing to deploy" in (
        done.stdout.replace("\n", " ")
    )


def test_a_new_release_goes_through_every_play(tmp_path: Path) -> None:
    done, marks = deploy_run(tmp_path, {"prefill-a": "r1", "decode-a": "r1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert len({m.split("-", 1)[0] for m in marks}) == len(plays("deploy.yml")) - next(
        i for i, p in enumerate(plays("deploy.yml")) if p.get("name") == FIRST_ACTING_PLAY
    )
    assert "is already the baseline on the canary nodes" not in done.stdout


def test_a_canary_half_on_the_release_is_refused_naming_rollback(tmp_path: Path) -> None:
    done, marks = deploy_run(tmp_path, {"prefill-a": "r2", "decode-a": "r1"})
    assert done.returncode != 0 and marks == []
    assert "only some run release r2" in done.stdout.replace("\n", " ") and "rollback.yml" in done.stdout


def test_a_canary_with_no_baseline_decode_node_is_refused_naming_the_pool(tmp_path: Path) -> None:
    done, marks = deploy_run(tmp_path, {"prefill-a": "r1", "decode-a": "r1"}, decode=["decode-a"])
    assert done.returncode != 0 and marks == []
    out = done.stdout.replace("\n", " ")
    assert "every decode node (decode-a) is in the canary" in out and "min_size and desired_size 2" in out


def test_one_decode_node_still_takes_a_no_op(tmp_path: Path) -> None:
    done, marks = deploy_run(tmp_path, {"prefill-a": "r2", "decode-a": "r2"}, decode=["decode-a"])
    assert done.returncode == 0 and marks == [], done.stdout[-4000:]
