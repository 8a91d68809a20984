"""The deployment contract: what every component listens on, answers probes on, is started with, reads as
PDSERVE_* settings and secret files, and is scraped as, derived once from the typed stack model (`Serving`) and
pdserve's own settings names.

Everything that deploys renders from here: the Ansible variables of the pdserve, prometheus and node_exporter
roles (pdstack/contract/files.py, committed per environment as playbooks/vars/contract/<env>.yml), the security
groups and the policy pack's port rules (infra/security.py), the Kubernetes control plane (infra/workloads/), the
cloud scrape config (infra/prometheus.py) and the alert rules' job selectors (monitoring/alerts.yml, checked against
`JOBS`).
tests/pdstack/contract/test_components.py parses what is rendered with pdserve's own settings loaders.

A module rather than a data file: the values are functions of the stack model (ports, limits, secrets), Pulumi and
the toolkit import it directly, and Ansible gets a rendered file that a test keeps equal to it (as it does for
inventories/local/hosts.yml), so the playbooks need neither the toolkit nor Python beyond Ansible's own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from pdserve.common.settings import env_name
from pdserve.vllm.settings import kv_ports_used
from pdstack.contract.serving_env import gateway_settings, server_settings, tracing_settings
from pdstack.model import Engine, KvConnector, PoolRole, Serving

# -- what pdserve itself fixes (serving/pdserve/*/settings.py, serving/Containerfile) --------------------------
PDSERVE_BIN = "/opt/pdserve/bin/pdserve"  # the image's venv (serving/Containerfile); its base image has no PATH
LISTEN_HOST = "0.0.0.0"  # noqa: S104 (containers listen on every address of their pod or host network)
SECRETS_DIR = "/run/secrets"
STATE_DIR = "/state"  # the scheduler's weights file lives here (a volume)
HEALTH_LIVE = "/health/live"
HEALTH_READY = "/health/ready"
SERVER_HEALTH = "/health"  # model servers also answer the plain vLLM-style /health
METRICS_PATH = "/metrics"
RUNTIME_UID = 10001  # the image's pdserve user

# -- what the other listeners fix --------------------------------------------------------------------------------
NODE_EXPORTER_PORT = 9100  # Debian's prometheus-node-exporter (roles/node_exporter)
PROMETHEUS_HEALTH_LIVE = "/-/healthy"
PROMETHEUS_HEALTH_READY = "/-/ready"
ALERTMANAGER_PORT = 9093
ALERTMANAGER_API = "/api/v2"  # alerts, silences (amtool and the tests use it)
# Redis: the gateways' shared rate-limit store (roles/redis locally, in-cluster in the cloud)
RATELIMIT_STORE_PORT = 6379
RATELIMIT_STORE_DB = 0

# -- where the cloud's scheduler is: its load balancer's URL, which the control-plane stack writes to SSM Parameter
# Store under this name (infra/program.py) and inventories/aws reads for the GPU nodes (pdstack_scheduler_endpoint)
SCHEDULER_URL_PARAMETER = "/pdstack/{env}/scheduler-url"
# -- the audience a self-joining node signs its join for (X-Pdstack-Scheduler-Audience, pdserve.scheduler.join): the
# scheduler's join_audience (infra/workloads) and what pdstack/node/bootstrap.py's join phase signs, one per environment
SCHEDULER_AUDIENCE = "pdstack-{env}-scheduler"
# -- and the cloud's Prometheus, which the controller's canary judge queries: its internal load balancer's URL, under
# this name (infra/program.py), read by inventories/aws as pdstack_prometheus_endpoint; the name reaches Ansible in
# the cloud environments' rendered contract vars (PROMETHEUS_URL_PARAMETER_VAR)
PROMETHEUS_URL_PARAMETER = "/pdstack/{env}/prometheus-url"
PROMETHEUS_URL_PARAMETER_VAR = "pdstack_prometheus_url_parameter"
# -- and the environment CA's certificate (public: what every client verifies the listeners with), under this name;
# inventories/aws reads it for the controller's calls (the canary's judge and golden check)
CA_CERTIFICATE_PARAMETER = "/pdstack/{env}/ca-certificate"
# -- and the environment's current release (pdstack/node/release.py: images by digest, the model and its manifest, the
# node bundle), which the deploy flow publishes and every self-joining GPU node reads at boot (#35)
RELEASE_PARAMETER = "/pdstack/{env}/release"
# -- what a self-joining GPU node (pdstack/node/) writes on its own disk for the roles it applies to itself: the
# secrets it read from Secrets Manager (tmpfs: never on disk, read again each boot), one file per stack secret and the
# pool's TLS files under tls/; the registry credentials, where roles/container_runtime's container_runtime_auth_file
# points podman; its bootstrap's metrics, in the directory Debian's prometheus-node-exporter reads text files from
# (its --collector.textfile.directory default, which roles/node_exporter keeps)
NODE_SECRETS_DIR = "/run/pdstack/secrets"
REGISTRY_AUTH_FILE = "/etc/containers/auth.json"
NODE_EXPORTER_TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
# The region the local environment's AWS APIs (moto in server mode) are addressed in: its datacenters' region is
# `local`, which no AWS API (nor moto) accepts
LOCAL_AWS_REGION = "us-east-1"

# -- names: every environment has one DNS zone, and each component or server pool a name in it,
# <component or pool>.<datacenter>.<zone>, e.g. gateway.control.prod.pdstack.internal. In the cloud the zone is
# <env>.<domain>, a Route53 private hosted zone associated with every datacenter's VPC (infra/dns.py), its domain
# pdstack-infra:dns_domain (default DNS_DOMAIN); certificates carry the same names (infra/certificates.py).
DNS_DOMAIN = "pdstack.internal"
# A kubernetes.io/tls Secret's keys, mounted as files under TLS_DIR (the component's certificate, its key, the CA)
TLS_DIR = "/run/tls"
TLS_CERT_FILE = "tls.crt"
TLS_KEY_FILE = "tls.key"
TLS_CA_FILE = "ca.crt"


@dataclass(frozen=True)
class Names:
    """The DNS names of one environment's components and pools, all under `zone`."""

    zone: str

    def host(self, name: str, datacenter: str) -> str:
        """A component's (gateway, scheduler) or a server pool's name in its datacenter."""
        return f"{name}.{datacenter}.{self.zone}"

    def instances(self, pool: str, datacenter: str) -> str:
        """The wildcard under a pool's name that its instances' own names fall in (certificates carry it)."""
        return f"*.{self.host(pool, datacenter)}"

    def instance(self, instance_id: str, pool: str, datacenter: str) -> str:
        """An instance's own name under its pool's (infra/lambdas/pool_records.py keeps its record; the server
        advertises it, so its callers verify the pool's certificate by that name)."""
        return f"{instance_id}.{self.host(pool, datacenter)}"


def cluster_service_name(app: str, namespace: str) -> str:
    """An in-cluster Service's DNS name: what its clients dial and its certificate carries."""
    return f"{app}.{namespace}.svc.cluster.local"


def tls_settings() -> dict[str, str]:
    """A pdserve component's HTTP TLS settings (pdserve.common.tls) from the files under TLS_DIR: its certificate
    for its listener and, towards the components it calls, as its client certificate (mutual TLS); the
    environment's CA to verify them."""
    cert, key, ca = (f"{TLS_DIR}/{f}" for f in (TLS_CERT_FILE, TLS_KEY_FILE, TLS_CA_FILE))
    return {
        setting("tls_cert"): cert,
        setting("tls_key"): key,
        setting("tls_ca"): ca,
        setting("tls_client_cert"): cert,
        setting("tls_client_key"): key,
    }


def tls_probe_command(port: int, path: str) -> list[str]:
    """A health check for a listener that requires a client certificate (serving.mutual_tls) where the prober has
    none (the kubelet): from inside the container, on loopback, presenting the component's own pair and checking
    the chain but not the name (127.0.0.1 is in no certificate)."""
    cert, key, ca = (f"{TLS_DIR}/{f}" for f in (TLS_CERT_FILE, TLS_KEY_FILE, TLS_CA_FILE))
    script = (
        f"import ssl, urllib.request; c = ssl.create_default_context(cafile={ca!r}); c.check_hostname = False; "
        f"c.load_cert_chain({cert!r}, {key!r}); "
        f"urllib.request.urlopen('https://127.0.0.1:{port}{path}', timeout=2, context=c)"
    )
    return ["python3", "-c", script]


def kv_tls_settings() -> dict[str, str]:
    """A prefill or decode server's KV channel TLS (pdserve.server.settings kv_tls_*) from the same files: prefill
    serves with its certificate, decode verifies it against the CA (prefill is reached by address: an IP SAN)."""
    cert, key, ca = (f"{TLS_DIR}/{f}" for f in (TLS_CERT_FILE, TLS_KEY_FILE, TLS_CA_FILE))
    return {setting("kv_tls_cert"): cert, setting("kv_tls_key"): key, setting("kv_tls_ca"): ca}


def cloud_names(env: str, domain: str = DNS_DOMAIN) -> Names:
    """A cloud environment's names: its private zone is <env>.<domain>."""
    return Names(f"{env}.{domain}")


# -- Prometheus job names: one scheme, used by the local and the cloud Prometheus ------------------------------
PROMETHEUS_JOB = "prometheus"
NODE_JOB = "node"


class Component(StrEnum):
    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def is_server(self) -> bool:
        return self in (Component.PREFILL, Component.DECODE, Component.COLOCATED)

    @property
    def job(self) -> str:
        """Its Prometheus job, locally and in the cloud (datacenter, pool, instance are labels, not job names)."""
        return f"pdserve-{self}"


SCRAPED = (Component.SCHEDULER, Component.GATEWAY, Component.PREFILL, Component.DECODE)
JOBS = (PROMETHEUS_JOB, *(c.job for c in SCRAPED), NODE_JOB)
"""Every scrape job either Prometheus has; alert rules may select only these."""


def setting(name: str) -> str:
    """The PDSERVE_* variable of a pdserve settings field: pdserve's own naming (pdserve.common.settings.env_name),
    which every component's loader reads."""
    return str(env_name(name))


@dataclass(frozen=True)
class SecretFile:
    """One credential a component reads from a file: which pdserve setting names it, which stack secret it comes
    from, and the file it is mounted as. With `principal`, the file holds the scheduler token derived from
    `secret` (the identity key) for that principal, never the key itself (serving/README.md, Trust)."""

    setting: str  # pdserve settings field, e.g. api_keys_file
    secret: str  # stack secret (pdstack.model.REQUIRED_SECRETS)
    file: str  # file name under SECRETS_DIR
    principal: str | None = None  # "gateway", or "instance" (a server's own instance:<id>, known at deploy time)
    only_with_shared_store: bool = False  # the rate-limit store's password: only where a shared store is used

    @property
    def variable(self) -> str:
        return setting(self.setting)

    @property
    def path(self) -> str:
        return f"{SECRETS_DIR}/{self.file}"

    @property
    def key(self) -> str:
        """Its key in the environment's Kubernetes Secret: the stack secret's name, or a derived token's."""
        return self.secret if self.principal is None else f"scheduler-{self.principal}-token"


KV_KEY = SecretFile("kv_key_file", "kv-channel-key", "kv.key")
SERVER_TOKEN = SecretFile("api_token_file", "server-api-token", "server.token")
INSTANCE_TOKEN = SecretFile("scheduler_token_file", "scheduler-identity-key", "scheduler.token", principal="instance")
# What the gateway's /metrics requires (its series name tenants, versions and instances; the gateway is the one
# listener clients reach). Prometheus holds the same file at the same path: the gateway job's credentials_file.
METRICS_TOKEN = SecretFile("metrics_token_file", "metrics-scrape-token", "metrics.token")
# The tenants' API keys: the cloud's gateway reads a file of their digests (gateway_keys_file), not the keys.
GATEWAY_API_KEYS = SecretFile("api_keys_file", "gateway-api-keys", "api-keys.json")
RATELIMIT_PASSWORD = SecretFile(
    "rate_limit_password_file", "ratelimit-store-password", "ratelimit.password", only_with_shared_store=True
)
SECRET_FILES: dict[Component, tuple[SecretFile, ...]] = {
    Component.GATEWAY: (
        GATEWAY_API_KEYS,
        SecretFile("scheduler_token_file", "scheduler-identity-key", "scheduler.token", principal="gateway"),
        SecretFile("server_token_file", "server-api-token", "server.token"),
        RATELIMIT_PASSWORD,
        METRICS_TOKEN,
    ),
    Component.SCHEDULER: (
        SecretFile("admin_token_file", "scheduler-admin-token", "admin.token"),
        SecretFile("identity_key_file", "scheduler-identity-key", "identity.key"),
    ),
    Component.PREFILL: (KV_KEY, SERVER_TOKEN, INSTANCE_TOKEN),
    Component.DECODE: (KV_KEY, SERVER_TOKEN, INSTANCE_TOKEN),
    Component.COLOCATED: (SERVER_TOKEN, INSTANCE_TOKEN),
}


def scheduler_url_parameter(env: str) -> str:
    return SCHEDULER_URL_PARAMETER.format(env=env)


def scheduler_audience(env: str) -> str:
    return SCHEDULER_AUDIENCE.format(env=env)


def prometheus_url_parameter(env: str) -> str:
    return PROMETHEUS_URL_PARAMETER.format(env=env)


def ca_certificate_parameter(env: str) -> str:
    return CA_CERTIFICATE_PARAMETER.format(env=env)


def release_parameter(env: str) -> str:
    return RELEASE_PARAMETER.format(env=env)


def secret_name(env: str, name: str) -> str:
    """A cloud environment's secret's name in Secrets Manager (infra/secrets.py, infra/certificates.py)."""
    return f"pdstack/{env}/{name}"


def tls_secret_name(env: str, datacenter: str, pool: str) -> str:
    """The Secrets Manager secret holding a server pool's certificate, key and CA (JSON by TLS_*_FILE name)."""
    return secret_name(env, f"tls/{datacenter}/{pool}")


def operator_tls_secret_name(env: str) -> str:
    """The Secrets Manager secret holding the operator's certificate (the controller's, under mutual TLS), likewise."""
    return secret_name(env, "tls/operator")


def gateway_keys_file(key: str, tenant: str) -> str:
    """The gateway's API keys file (pdserve.gateway.auth) for one tenant holding `key`: its sha256 digest only, so
    the file the gateway reads never holds a key a client could present."""
    return json.dumps({tenant: [f"sha256:{hashlib.sha256(key.encode()).hexdigest()}"]}, indent=2) + "\n"


@dataclass(frozen=True)
class ComponentContract:
    component: Component
    port: int  # HTTP: API, probes, /metrics
    kv_port: int | None  # the KV channel (prefill): the first of kv_ports
    settings: Mapping[str, str]  # PDSERVE_* values that do not depend on the host it runs on
    secrets: tuple[SecretFile, ...]
    health_live: str = HEALTH_LIVE
    health_ready: str = HEALTH_READY
    metrics_path: str = METRICS_PATH
    kv_ports: range = range(0)  # every port it listens on for KV (see kv_port_range)
    # pdserve.common.tls ClientAuth of its listener: "required" on the internal ones under serving.mutual_tls
    tls_client_auth: str = "none"

    @property
    def args(self) -> tuple[str, ...]:
        """What follows the image's entry point (`pdserve ROLE`)."""
        return (str(self.component),)

    @property
    def command(self) -> tuple[str, ...]:
        return (PDSERVE_BIN, *self.args)

    @property
    def job(self) -> str:
        return self.component.job

    @property
    def ports(self) -> dict[str, int]:
        return {"http": self.port} | ({"kv": self.kv_port} if self.kv_port is not None else {})

    def tls_env(self) -> dict[str, str]:
        """Its TLS settings from the files under TLS_DIR (tls_settings), the KV channel's too on prefill and decode
        (kv_tls_settings), and whether its listener requires client certificates."""
        kv = kv_tls_settings() if self.component in (Component.PREFILL, Component.DECODE) else {}
        return {**tls_settings(), **kv, setting("tls_client_auth"): self.tls_client_auth}

    def env(self, shared_store: bool = True) -> dict[str, str]:
        """Its PDSERVE_* settings including the secret files; without a shared rate-limit store the gateway reads
        no store password."""
        files = {s.variable: s.path for s in self.secrets if shared_store or not s.only_with_shared_store}
        return {**self.settings, **files}


@dataclass(frozen=True)
class Listener:
    """A listener that is not pdserve's: Prometheus, node_exporter, Alertmanager."""

    port: int
    job: str | None
    health_live: str | None = None
    health_ready: str | None = None


@dataclass(frozen=True)
class ScrapeGroup:
    """One Prometheus job over the hosts of one inventory group (locally) or tagged role (in the cloud)."""

    job: str
    group: str  # inventory group = pdstack:role tag value
    port: int
    # the bearer token its targets' /metrics require, a file Prometheus holds at credentials.path (the gateway's)
    credentials: SecretFile | None = None

    def authorization(self) -> dict[str, str] | None:
        """Its Prometheus `authorization` block, None for a job whose targets take no token."""
        if self.credentials is None:
            return None
        return {"type": "Bearer", "credentials_file": self.credentials.path}


@dataclass(frozen=True)
class Contract:
    components: Mapping[Component, ComponentContract]
    prometheus: Listener
    node_exporter: Listener
    alertmanager: Listener
    ratelimit_store: Listener
    scrape_groups: tuple[ScrapeGroup, ...] = field(default=())
    mutual_tls: bool = False  # serving.mutual_tls: every caller of an internal listener presents its certificate

    def __getitem__(self, component: Component | str) -> ComponentContract:
        return self.components[Component(component)]

    def node_secrets(self) -> tuple[str, ...]:
        """The stack secrets a serving node reads as they are, in order: what its instance may fetch. Not a secret a
        token is derived from (the scheduler's identity key: whoever holds it can mint any principal's token), so each
        node gets only its own derived token from the deployer."""
        serving = (Component.PREFILL, Component.DECODE, Component.COLOCATED)
        return tuple(dict.fromkeys(s.secret for c in serving for s in self[c].secrets if s.principal is None))

    def ratelimit_storage(self, host: str) -> str:
        """The gateways' PDSERVE_RATE_LIMIT_STORAGE for the store on `host`, which serves TLS only."""
        return f"rediss://{host}:{self.ratelimit_store.port}/{RATELIMIT_STORE_DB}"


def kv_port_range(serving: Serving) -> range:
    """The ports a prefill node listens on for KV, from serving.ports.kv up: one for pdserve's servers; with vLLM one
    per worker (PdstackConnector: each TP rank of each DP engine, pdserve.vllm.settings.kv_port_of) or one per DP
    engine (NIXL's side channel). Security groups and the policy pack open all of them to decode, and no other."""
    base = serving.ports.kv
    if serving.engine is not Engine.VLLM or serving.vllm is None:
        return range(base, base + 1)
    role = serving.vllm.role(PoolRole.PREFILL)
    if serving.vllm.kv_connector is KvConnector.NIXL:
        return range(base, base + role.data_parallel_size)
    return range(base, base + kv_ports_used(role.tensor_parallel_size, role.data_parallel_size))


def contract(serving: Serving) -> Contract:
    ports = serving.ports
    common = {setting("host"): LISTEN_HOST}
    server = server_settings(serving, kv=True)

    def make(
        component: Component, port: int, extra: Mapping[str, str], kv_ports: range = range(0)
    ) -> ComponentContract:
        values = {**common, setting("port"): str(port), **extra}
        kv_port = kv_ports.start if kv_ports else None
        # the gateway is the clients' door: server-only TLS and API keys, never client certificates
        client_auth = "required" if serving.mutual_tls and component is not Component.GATEWAY else "none"
        return ComponentContract(
            component, port, kv_port, values, SECRET_FILES[component], kv_ports=kv_ports, tls_client_auth=client_auth
        )

    components = {
        Component.GATEWAY: make(Component.GATEWAY, ports.gateway, gateway_settings(serving)),
        Component.SCHEDULER: make(
            Component.SCHEDULER,
            ports.scheduler,
            {setting("state_file"): f"{STATE_DIR}/weights.json", **tracing_settings(serving)},
        ),
        Component.PREFILL: make(Component.PREFILL, ports.prefill, server, kv_ports=kv_port_range(serving)),
        Component.DECODE: make(Component.DECODE, ports.decode, server),
        # colocated stands where decode stands (a mixed node serves both without the KV channel)
        Component.COLOCATED: make(Component.COLOCATED, ports.decode, server_settings(serving, kv=False)),
    }
    scrape = tuple(
        ScrapeGroup(
            c.job,
            "control" if c in (Component.GATEWAY, Component.SCHEDULER) else str(c),
            components[c].port,
            METRICS_TOKEN if METRICS_TOKEN in SECRET_FILES[c] else None,
        )
        for c in SCRAPED
    )
    return Contract(
        components=components,
        prometheus=Listener(ports.prometheus, PROMETHEUS_JOB, PROMETHEUS_HEALTH_LIVE, PROMETHEUS_HEALTH_READY),
        node_exporter=Listener(NODE_EXPORTER_PORT, NODE_JOB),
        alertmanager=Listener(ALERTMANAGER_PORT, None, PROMETHEUS_HEALTH_LIVE, PROMETHEUS_HEALTH_READY),
        ratelimit_store=Listener(RATELIMIT_STORE_PORT, None),
        scrape_groups=scrape,
        mutual_tls=serving.mutual_tls,
    )
