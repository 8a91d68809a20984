"""A whole control plane on loopback for the gateway tests: scheduler, real prefill/decode servers, gateways."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.scheduler.client import bearer
from tests.support.services import (
    Service,
    gateway_token_file,
    instance_token_file,
    principal_token,
    start_scheduler,
    write_secret,
)

# One client for the test requests: building an httpx client per request costs more than a tiny-model completion.
HTTP = httpx.Client(timeout=60)
KEYS = {
    "acme": "sk-acme-0123456789abcdef",
    "slow": "sk-slow-0123456789abcdef",
    "budget": "sk-budget-0123456789",
    "bulk": "sk-bulk-0123456789abcdef",
    "scarce": "sk-scarce-0123456789abcd",
}


FOUR_SERVERS = (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"))


def write_keys_file(path: Path) -> Path:
    """acme by sha256 digest with default limits; slow (1 request/s, burst 2), budget (300 tokens/min), bulk
    (limits far above what a load test sends, so load tests measure routing, not the rate limiter), and scarce
    (3 requests, then one per 100 s: a count a test can reach however slow the machine)."""
    digest = "sha256:" + hashlib.sha256(KEYS["acme"].encode()).hexdigest()
    document = {
        "acme": [digest],
        "slow": {"keys": [KEYS["slow"]], "requests_per_second": 1, "request_burst": 2},
        "budget": {"keys": ["sha256:" + hashlib.sha256(KEYS["budget"].encode()).hexdigest()], "tokens_per_minute": 300},
        "bulk": {
            "keys": [KEYS["bulk"]],
            "requests_per_second": 1000,
            "request_burst": 1000,
            "tokens_per_minute": 10_000_000,
        },
        "scarce": {"keys": [KEYS["scarce"]], "requests_per_second": 0.01, "request_burst": 3},
    }
    path.write_text(json.dumps(document))
    return path


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there are none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for(predicate: Any, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s")


def counting_tokens(model: Path, offload_threshold: int) -> tuple[str, ...]:
    """Gateway flags: count prompt tokens with `model`'s tokenizer, send prompts of `offload_threshold` tokens or more
    to remote prefill."""
    return ("--tokenizer-file", str(model / "tokenizer.json"), "--offload-threshold-tokens", str(offload_threshold))


@dataclass
class Cluster:
    tmp: Path
    kv_key_file: Path
    missed_heartbeats: int = 50
    """At 0.2 s heartbeats: dead after 10 s of silence, so a busy machine does not flap instances."""
    scheduler: Service | None = None
    admin_token: str = ""
    servers: dict[str, Service] = field(default_factory=dict)
    gateways: list[Service] = field(default_factory=list)

    def start_scheduler(self) -> None:
        self.scheduler, self.admin_token = start_scheduler(
            self.tmp, heartbeat_interval=0.2, missed=self.missed_heartbeats
        )

    @property
    def server_token_file(self) -> Path:
        """The API token prefill and decode require and the gateway presents (contract §2)."""
        path = self.tmp / "server-api.token"
        if not path.exists():
            write_secret(path)
        return path

    @property
    def metrics_token_file(self) -> Path:
        """The token a gateway's /metrics requires once it is given as --metrics-token-file (deployed gateways always
        are; one on loopback without it serves /metrics openly)."""
        path = self.tmp / "metrics-scrape.token"
        if not path.exists():
            write_secret(path)
        return path

    def metrics_flags(self) -> tuple[str, ...]:
        """Gateway flags: /metrics requires metrics_token_file."""
        return ("--metrics-token-file", str(self.metrics_token_file))

    def metrics_auth(self) -> dict[str, str]:
        """What Prometheus presents to such a gateway's /metrics."""
        return bearer(self.metrics_token_file.read_text().strip())

    def launch_server(self, name: str, role: str, model: Path, version: str = "v1") -> Service:
        assert self.scheduler is not None
        engine_id = hashlib.sha256(f"{self.tmp}/{name}".encode()).hexdigest()[:32]
        token_file = instance_token_file(self.tmp, f"{role}-{engine_id[:24]}")  # the id the server registers as
        args = [
            "--model",
            str(model),
            "--kv-key-file",
            str(self.kv_key_file),
            "--scheduler-url",
            self.scheduler.url,
            "--scheduler-token-file",
            str(token_file),
            "--engine-id",
            engine_id,
            "--api-token-file",
            str(self.server_token_file),
            "--heartbeat-seconds",
            "0.2",
            "--version",
            version,
            "--served-model-name",
            "dense",
        ]
        if role == "prefill":
            args += ["--kv-port", "0"]
        server = Service("pdserve.cli", args, self.tmp / f"{name}.log", role=[role])
        self.servers[name] = server.launch()
        return server

    def start_gateway(self, *flags: str) -> Service:
        assert self.scheduler is not None
        keys = write_keys_file(self.tmp / "api-keys.json")
        args = [
            "--scheduler-url",
            self.scheduler.url,
            "--api-keys-file",
            str(keys),
            "--scheduler-token-file",
            str(gateway_token_file(self.tmp)),
            "--server-token-file",
            str(self.server_token_file),
            "--routing-poll-interval",
            "0.1",
            *flags,
        ]
        gateway = Service("pdserve.gateway", args, self.tmp / f"gateway-{len(self.gateways)}.log").start()
        self.gateways.append(gateway)
        return gateway

    def start_pd(self, servers: list[tuple[str, str, Path, str]], *gateway_flags: str) -> Service:
        """The scheduler, the servers (name, role, model, version) and one gateway, once it routes to all of them."""
        self.start_scheduler()
        for name, role, model, version in servers:
            self.launch_server(name, role, model, version)
        self.wait_servers()
        gateway = self.start_gateway(*gateway_flags)
        self.wait_routable(gateway, len(servers))
        return gateway

    def wait_servers(self) -> None:
        for server in self.servers.values():
            if server.process is not None and server.process.poll() is None:
                server.wait("/health/ready", timeout=180)  # model loads crawl on a loaded CI host

    def wait_routable(self, gateway: Service, instances: int) -> None:
        """Until the gateway's routing table lists `instances` ready instances."""
        wait_for(
            lambda: httpx.get(f"{gateway.url}/health/ready").json()["instances"] == instances,
            what=f"{instances} routable instances",
        )

    def sync(self, gateway: Service) -> None:
        """Until the gateway uses a routing table at least as new as the scheduler's current one."""
        assert self.scheduler is not None
        target = httpx.get(f"{self.scheduler.url}/v1/routing", headers=self.gateway_auth()).json()["generation"]
        wait_for(
            lambda: httpx.get(f"{gateway.url}/health/ready").json()["routing_generation"] >= target,
            what="gateway routing table in sync",
        )

    def instance_auth(self, instance_id: str) -> dict[str, str]:
        """What the server registered as `instance_id` (and the drain before its stop) presents to the scheduler."""
        return bearer(principal_token(self.tmp, f"instance:{instance_id}"))

    def gateway_auth(self) -> dict[str, str]:
        """What a gateway presents to read the scheduler's routing table and instances."""
        return bearer(principal_token(self.tmp, "gateway"))

    def server_auth(self) -> dict[str, str]:
        return bearer(self.server_token_file.read_text().strip())

    def instances(self) -> list[dict[str, Any]]:
        """The scheduler's registry, as a gateway may read it."""
        assert self.scheduler is not None
        listed: list[dict[str, Any]] = httpx.get(
            f"{self.scheduler.url}/v1/instances", headers=self.gateway_auth()
        ).json()["instances"]
        return listed

    def instance_id(self, name: str) -> str:
        port = f":{self.servers[name].port}"
        for entry in self.instances():
            if entry["info"]["url"].endswith(port):
                return str(entry["instance_id"])
        raise KeyError(name)

    def served(self, name: str) -> float:
        """Completion requests a server answered with 200, by its own /metrics."""
        text = httpx.get(f"{self.servers[name].url}/metrics", headers=self.server_auth()).text
        return sum(
            metric(text, "pdserve_requests_total", status="200", endpoint=endpoint)
            for endpoint in ("/v1/completions", "/v1/chat/completions")
        )

    def running(self, name: str) -> float:
        return metric(httpx.get(f"{self.servers[name].url}/metrics").text, "pdserve_running_requests")

    def stop(self) -> None:
        for service in [*self.gateways, *self.servers.values()]:
            service.stop()
        if self.scheduler is not None:
            self.scheduler.stop()
