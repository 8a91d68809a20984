"""The scheduler's wire format: what instances register and report, and the routing table gateways poll."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["prefill", "decode", "colocated"]
# An instance's id, which is also its principal's (instance:<id>, pdserve.scheduler.identity).
INSTANCE_ID_PATTERN = r"^[A-Za-z0-9._:-]+$"


def instance_id_field(description: str) -> Any:
    """An optional instance id field, as InstanceInfo takes it (the agent registers with its own)."""
    return Field(None, min_length=1, max_length=128, pattern=INSTANCE_ID_PATTERN, description=description)


def version_field() -> Any:
    """The release an instance runs (model + server), the unit a canary weighs."""
    return Field(min_length=1, max_length=64, description="release of model + server, the canary unit")


State = Literal["starting", "ready", "draining", "dead"]

# Request fields pdserve's own engine does not implement. A backend that does (vLLM: tools, response_format, ...)
# lists them in InstanceInfo.supported_params; the gateway refuses any of them that not every ready instance lists.
ENGINE_OPTIONAL_PARAMS = (
    "best_of",
    "tools",
    "tool_choice",
    "response_format",
    "logit_bias",
    "repetition_penalty",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "presence_penalty",
    "frequency_penalty",
    "suffix",
)


class InstanceLoad(BaseModel):
    """Load figures an instance sends with every heartbeat."""

    model_config = ConfigDict(extra="forbid")

    ready: bool = Field(True, description="the instance has its model loaded and accepts requests")
    queue_depth: int = Field(0, ge=0, description="requests waiting for a slot")
    active_requests: int = Field(0, ge=0, description="requests being prefilled or decoded")
    max_concurrency: int = Field(1, ge=1, description="request slots (decode batch size or prefill concurrency)")
    kv_used_bytes: int = Field(0, ge=0, description="KV cache memory in use")
    kv_capacity_bytes: int = Field(0, ge=0, description="KV cache memory budget; 0 if unknown")
    outstanding_prompt_tokens: int = Field(0, ge=0, description="prompt tokens admitted but not yet prefilled")

    def slot_utilisation(self) -> float:
        return min(1.0, (self.active_requests + self.queue_depth) / self.max_concurrency)

    def kv_utilisation(self) -> float:
        return self.kv_used_bytes / self.kv_capacity_bytes if self.kv_capacity_bytes else 0.0

    def utilisation(self) -> float:
        """The busier of slots and KV memory, in [0, 1]."""
        return max(self.slot_utilisation(), min(1.0, self.kv_utilisation()))


class InstanceInfo(BaseModel):
    """What an instance tells the scheduler when it registers; it does not change while the instance lives."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str | None = instance_id_field(
        "stable id chosen by the instance (re-registering with it is idempotent); generated if absent"
    )
    role: Role
    version: str = version_field()
    kv_fingerprint: str = Field(min_length=1, max_length=128, description="engine KV fingerprint; pairs must match")
    url: str = Field(pattern=r"^https?://[^/\s]+$", description="advertised base URL, e.g. http://10.0.0.5:8100")
    model: str = Field("", max_length=256, description="served model name")
    kv_host: str | None = Field(None, description="KV channel host (prefill only)")
    kv_port: int | None = Field(None, ge=1, le=65535, description="KV channel port (prefill only)")
    min_prompt_tokens: int = Field(0, ge=0, description="prefill length bucket: shortest prompt it takes")
    max_prompt_tokens: int | None = Field(None, ge=1, description="prefill length bucket: longest prompt it takes")
    supported_params: list[str] = Field(
        default_factory=list, max_length=64, description="ENGINE_OPTIONAL_PARAMS this backend honours"
    )
    max_model_len: int | None = Field(None, ge=1, description="context length: prompt + generated tokens")
    kv_streaming: bool = Field(
        False,
        description="serves KV while prefill computes (early dispatch): the gateway may send prefill and "
        "decode at once when both instances of a pair declare it",
    )


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    load: InstanceLoad = Field(default_factory=InstanceLoad)


class RoutedInstance(BaseModel):
    """One instance as the routing table shows it."""

    instance_id: str
    state: State
    info: InstanceInfo
    load: InstanceLoad


class RoutingTable(BaseModel):
    """Ready instances and version weights; `generation` changes whenever anything in it does."""

    generation: int
    weights: dict[str, float]
    instances: list[RoutedInstance]


class WeightsUpdate(BaseModel):
    """Traffic weights per version. Versions not named get no traffic, unless no weights are set at all."""

    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float] = Field(description="version -> non-negative weight")


class CanaryVerdict(BaseModel):
    """What `pdstack canary judge` concluded at one canary step, recorded by the deploy playbook."""

    model_config = ConfigDict(extra="forbid")

    canary: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$", description="version judged")
    baseline: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$", description="compared with")
    step_percent: int = Field(ge=0, le=100, description="the canary's share of traffic at this step")
    outcome: Literal["pass", "fail", "inconclusive"]


# -- A node joining by itself (pdserve.scheduler.join): its instance role's signed sts:GetCallerIdentity, replayed by
# the scheduler to STS, buys the token of its own principal. The node's side is pdstack.node.join.
JOIN_PATH = "/v1/join"
# The header naming the scheduler a signed request is meant for (as Vault's X-Vault-AWS-IAM-Server-ID): the node
# signs it, so a request one scheduler received cannot be replayed to another that expects a different audience.
AUDIENCE_HEADER = "X-Pdstack-Scheduler-Audience"
STS_ACTION_BODY = "Action=GetCallerIdentity&Version=2011-06-15"
# pdserve's server registers as <role>-<engine id[:24]> (pdserve.server.heartbeat): a longer engine id would
# register under another id than its token's.
ENGINE_ID_MAX = 24


def sts_regional_url(region: str) -> str:
    """STS's regional endpoint, where a node signs and the scheduler replays (never the global one)."""
    return f"https://sts.{region}.amazonaws.com/"


class JoinRequest(BaseModel):
    """The parts of a signed sts:GetCallerIdentity request (never the credentials that signed it)."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(max_length=8, description="POST")
    url: str = Field(max_length=512, description="the STS endpoint the request was signed for")
    headers: dict[str, str] = Field(
        max_length=32, description="the signed request's headers: Authorization, X-Amz-Date, the audience header..."
    )
    body: str = Field(max_length=256, description=STS_ACTION_BODY)
    engine_id: str | None = Field(
        None,
        max_length=ENGINE_ID_MAX,
        pattern=r"^i-[0-9a-f]{8,17}(-[a-z0-9]{1,8})?$",
        description="the engine id to be named by: the instance id, or <instance id>-<tag>; default the instance id",
    )


class JoinAnswer(BaseModel):
    """What a node that joined gets: its instance id at the scheduler and that principal's token."""

    instance_id: str
    principal: str
    token: str
