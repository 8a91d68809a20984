"""The local environment as its end-to-end tests see it: `pdstack local up`'s output and status, its APIs, a release
deployed through playbooks/deploy.yml, and the checks the pdserve and vLLM runs share (tests/local/test_local_*.py).

A module's `local` fixture runs `up` (from nothing, or again: a warm `up` changes nothing and takes seconds) and
leaves the environment up; only the down test takes it away, so the modules also run as separate pytest sessions
(the Makefile runs both in one session, alone on the machine after its two lanes)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx

from pdstack.bench.endpoint import Endpoint
from pdstack.contract.components import Component, Contract, contract
from pdstack.local import nodes
from pdstack.local.converged import running_containers
from pdstack.local.env import LocalEnv
from pdstack.local.network import namespaces
from pdstack.local.topology import Topology
from pdstack.model import PoolRole
from tests.local.load import ClientLoad
from tests.local.operator import operator_context
from tests.support import REPO
from tests.support.ansible import RECAP

PDSTACK = str(REPO / ".venv" / "bin" / "pdstack")
LOAD_RATE = 5.0  # requests/s: what the local stack's canary policy (min_samples 10 at a 20 % step) is sized for


def pdstack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PDSTACK, *args], capture_output=True, text=True, cwd=REPO, check=False)


@dataclass
class Local:
    env: LocalEnv
    topology: Topology
    up_output: str
    status: dict[str, Any]

    @property
    def control(self) -> str:
        return str(self.status["gateway_url"]).split("//")[1].split(":")[0]

    def api_key(self) -> str:
        return Path(self.status["api_key_file"]).read_text().strip()

    def endpoint(self) -> Endpoint:
        """The gateway's completions, of the model `up` deployed (the engine's: pdserve's or vLLM's)."""
        return Endpoint(self.status["gateway_url"], "completions", self.status["model"], self.api_key())

    def gateway_metrics(self) -> str:
        """The gateway's /metrics, as Prometheus reads it: presenting the metrics token (without it: 401)."""
        token = self.env.secrets.metrics_scrape_token.read_text().strip()
        url = f"https://{self.control}:{self.contract[Component.GATEWAY].port}/metrics"
        assert httpx.get(url, timeout=10).status_code == 401, "the gateway's /metrics answers without its token"
        response = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert response.status_code == 200, response.text
        return response.text

    @property
    def contract(self) -> Contract:
        return contract(self.topology.serving)

    @property
    def scheduler(self) -> str:
        return str(self.status["scheduler_url"])

    @cached_property
    def internal(self) -> httpx.Client:
        """A client of the scheduler's, the servers' and Prometheus' APIs (tests/local/operator.py)."""
        return httpx.Client(verify=operator_context(self.status))

    def scheduler_admin(self) -> dict[str, str]:
        """The scheduler's read endpoints need a token (the gateway's or the admin's): the tests read as admin."""
        return {"Authorization": f"Bearer {self.env.secrets.scheduler_admin_token.read_text().strip()}"}

    def instances(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.internal.get(
            f"{self.scheduler}/v1/instances", headers=self.scheduler_admin(), timeout=10
        ).json()["instances"]
        return found

    def weights(self) -> dict[str, int]:
        weights: dict[str, int] = self.internal.get(
            f"{self.scheduler}/v1/admin/weights", headers=self.scheduler_admin(), timeout=10
        ).json()["weights"]
        return weights

    def release(self) -> dict[str, Any]:
        release: dict[str, Any] = json.loads(self.env.release_file.read_text())["pdstack_release"]
        return release

    def record(self, node: str, component: str) -> dict[str, Any]:
        text = nodes.exec_in_node(node, ["cat", f"/var/lib/pdstack/pdserve/{component}.release.json"])
        record: dict[str, Any] = json.loads(text)
        return record

    def running_release(self, node: str, component: str) -> list[str]:
        """The -e arguments of the release the node runs now (a canary test's, once promoted): a play with them
        changes only what the test changes."""
        path = self.env.state_dir / f"release-{self.record(node, component)['current']['version']}.json"
        return ["-e", f"@{path}"] if path.exists() else []

    def servers(self) -> list[tuple[str, str]]:
        """(node, component) of every prefill and decode server."""
        return [(n.name, str(n.role)) for n in self.topology.nodes if str(n.role) in ("prefill", "decode")]

    def versions(self) -> dict[str, str]:
        """The release version each server's record says it runs, by node."""
        return {node: self.record(node, component)["current"]["version"] for node, component in self.servers()}

    def baseline(self) -> str:
        """The one release every server runs: what a canary test starts from, whatever ran before it."""
        running = set(self.versions().values())
        assert len(running) == 1, f"servers run different releases: {self.versions()}"
        return running.pop()

    def deploy(
        self, version: str, config_version: str, settings: dict[str, Any] | None = None, **release: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run playbooks/deploy.yml for a release of the current image with this version and config; `settings`:
        extra vars the release changes too (with vLLM, the rendered command lines `pdstack_vllm_vars`)."""
        path = self.env.state_dir / f"release-{version}.json"
        release = {**self.release(), "version": version, "config_version": config_version, **release}
        path.write_text(json.dumps({"pdstack_release": release, **(settings or {})}))
        argv = self.env.playbook_argv("deploy.yml", "-e", f"@{path}")
        return self.operator(argv)

    def operator(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        """An operator's Ansible command (`ansible-playbook`, `ansible`) from the checkout, with its settings."""
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.env.state_dir),
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1",
        }
        return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False, env=env)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wan_bytes(local: Local, a: str, b: str) -> int:
    """Bytes received by datacenter `b`'s router from its WAN link to `a` (the forwarder's TUN device)."""
    dc_b = local.topology.datacenter(b)
    link = next(lk for lk in local.topology.links if {lk.a, lk.b} == {a, b})
    shown = subprocess.run(
        ["ip", "-n", dc_b.router_namespace, "-s", "-j", "link", "show", link.device_towards(a)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(shown)[0]["stats64"]["rx"]["bytes"])


def brought_up(*up_args: str) -> Iterator[Local]:
    """`pdstack local up` with these arguments, then the environment as the tests see it."""
    up = pdstack("local", "up", *up_args)
    assert up.returncode == 0, (up.stdout + up.stderr)[-6000:]
    status = json.loads(pdstack("local", "status", "--json").stdout)
    env = LocalEnv(REPO)
    # Every client here (httpx, the openai client, the load and the bench) verifies the environment's CA, as
    # docs/local.md tells a user to; the TLS tests below build their clients explicitly instead.
    before = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = status["ca_file"]
    try:
        yield Local(env, env.topology(), up.stdout + up.stderr, status)
    finally:
        if before is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = before


def assert_a_warm_up_changes_nothing(env: LocalEnv, topology: Topology, *up_args: str) -> None:
    """A warm up skips the playbooks (#19): nothing they read changed, and every node runs what they left. That a
    second converge changes nothing is tests/roles' and tests/deploy's (test_second_run_changes_nothing, ...)."""
    release = env.release_file.read_text()
    names = [n.name for n in topology.nodes]
    before = running_containers(names)
    again = pdstack("local", "up", *up_args)
    assert again.returncode == 0, (again.stdout + again.stderr)[-6000:]
    assert "ansible: skipped playbooks/site.yml on every node" in again.stderr, again.stderr[-3000:]
    assert not RECAP.search(again.stdout + again.stderr)  # no play ran
    assert running_containers(names) == before  # not a container replaced
    assert env.release_file.read_text() == release  # same images by digest, same config


def fresh_version(name: str) -> str:
    """A release version no earlier deploy used (deploy.yml refuses a release its canary nodes already run)."""
    return f"{name}-{secrets.token_hex(4)}"


def assert_promoted_under_load(local: Local, name: str, build: str, engine: str) -> None:
    """A new release (`name` and a suffix of its own) deployed under load passes its canary and replaces the release
    every server ran, on every server and for all traffic, no request failing."""
    baseline, version = local.baseline(), fresh_version(name)
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        deployed = local.deploy(version, build)
    assert deployed.returncode == 0, deployed.stdout[-6000:]
    assert f"release {version} promoted" in deployed.stdout
    assert load.completed() > 50 and not load.failures(), load.failures()
    for node, component in local.servers():
        record = local.record(node, component)
        current = record["current"]
        assert (current["version"], current.get("stack", {}).get("engine", "pdserve")) == (version, engine), node
        assert record["previous"]["version"] == baseline, node
    assert local.weights() == {version: 100}


def assert_back_on(local: Local, baseline: str, canary: str) -> None:
    """Every server runs `baseline` again, which takes all traffic; the rolled-back `canary` takes none."""
    versions = local.versions()
    assert set(versions.values()) == {baseline}, versions
    weights = local.weights()
    assert (weights.get(baseline), weights.get(canary, 0)) == (100, 0), weights


def assert_a_killed_decode_recovers(local: Local, container: str, restart_s: float) -> None:
    """Under load, the first decode node's `container` is killed: podman restarts it, it is healthy again within
    `restart_s`, the requests after that all succeed, and the gateway carried the others on the other decode."""
    node = local.topology.nodes_with_role(PoolRole.DECODE)[0].name
    pid = nodes.exec_in_node(node, ["podman", "inspect", "--format", "{{.State.Pid}}", container]).strip()
    with ClientLoad(local.endpoint(), rate_per_s=LOAD_RATE) as load:
        time.sleep(5)
        nodes.exec_in_node(node, ["kill", "-KILL", pid])
        deadline = time.monotonic() + restart_s
        while time.monotonic() < deadline:
            now = nodes.exec_in_node(
                node, ["podman", "inspect", "--format", "{{.State.Pid}} {{.State.Health.Status}}", container]
            ).split()
            if now[0] not in ("0", pid) and now[1:] == ["healthy"]:
                break
            time.sleep(2)
        else:
            raise AssertionError(f"{container} was not restarted and healthy within {restart_s:.0f} s")
        recovered_at = time.perf_counter()
        time.sleep(15)
    results = load.results
    after = [r for r in results if r.start_s > recovered_at - load.started_at + 5]
    assert after and all(r.ok for r in after), [r.detail for r in after if not r.ok]
    # The gateway retries a failed decode on the other one; at most the streams cut off mid-way fail.
    assert sum(not r.ok for r in results) <= 0.1 * len(results), load.failures()


def assert_down_leaves_nothing(local: Local) -> None:
    """`pdstack local down` removes every node, namespace, link, rule, the registry and the names' hosts block."""
    down = pdstack("local", "down")
    assert down.returncode == 0, down.stderr[-3000:]
    assert not any(nodes.node_exists(n.name) for n in local.topology.nodes)
    assert not [ns for ns in namespaces() if ns.startswith("pds")]
    assert local.env.network(local.topology).leftovers() == []
    assert "netem" not in subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, check=False).stdout
    assert not local.env.registry().healthy()
    assert "local.pdstack" not in Path("/etc/hosts").read_text()  # the names' block is gone, the rest stays
