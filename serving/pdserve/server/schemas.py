"""OpenAI-compatible request bodies (with vLLM's extensions) and the KV transfer parameters of the PD protocol.

Unknown fields are ignored, as OpenAI clients send many; fields pdserve cannot honour are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.common.params import ParamError, check_generation_params
from pdserve.engine import SamplingParams
from pdserve.scheduler.protocol import ENGINE_OPTIONAL_PARAMS

# The fields vLLM's decode refuses to work without (NixlConnector), plus what pdstack adds to verify the KV.
REQUIRED_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
PDSTACK_REMOTE_FIELDS = ("kv_checksum", "kv_fingerprint", "num_tokens")
MAX_SEED = 2**63 - 1
# Values of ENGINE_OPTIONAL_PARAMS that ask for nothing (OpenAI's defaults), so they need no support; null and empty
# lists/objects ask for nothing too.
NEUTRAL_ENGINE_PARAM_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "repetition_penalty": (1,),
    "tool_choice": ("none",),
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
}


class RequestError(ValueError):
    """A request pdserve refuses; `param` names the offending field and `status` the HTTP status to answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind


class KVTransferParams(BaseModel):
    """vLLM's `kv_transfer_params` (NixlConnector field names) plus pdstack's verification fields."""

    model_config = ConfigDict(extra="allow")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(None, ge=1, le=65535)
    remote_block_ids: list[Any] | None = None
    kv_checksum: str | None = None
    kv_fingerprint: str | None = None
    num_tokens: int | None = Field(None, ge=1)

    def missing_remote_fields(self) -> list[str]:
        return [name for name in (*REQUIRED_REMOTE_FIELDS, *PDSTACK_REMOTE_FIELDS) if getattr(self, name) is None]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int | None = Field(None, ge=0)
    logprobs: Any = None
    top_logprobs: Any = None
    return_token_ids: bool = False  # vLLM extension: prompt_token_ids and token_ids in the choices
    kv_transfer_params: KVTransferParams | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: Any) -> Any:
        if value not in (None, 0) or isinstance(value, bool):
            raise ValueError("top_logprobs are not supported (logprobs are not)")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens or 0,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


RequestT = TypeVar("RequestT", bound=_GenerationRequest)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # content parts: keep the text ones, in order
            message["content"] = "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _completion_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def refuse_unhonoured_params(body: dict[str, Any]) -> None:
    """A parameter the engine would silently ignore is refused by name instead (OpenAI clients expect it to work);
    `best_of: 1`, `repetition_penalty: 1` and the like ask for nothing and pass."""
    for name in ENGINE_OPTIONAL_PARAMS:
        value = body.get(name)
        if value in (None, [], {}, "") or value in NEUTRAL_ENGINE_PARAM_VALUES.get(name, ()):
            continue
        raise RequestError(f"{name}: not supported by this server's engine (pdserve); leave it out", param=name)


def parse_request(model: type[RequestT], body: Any) -> RequestT:
    """Validate a decoded JSON body, turning the first problem into a RequestError naming its field."""
    if not isinstance(body, dict):
        raise RequestError("body: must be a JSON object", param="body")
    refuse_unhonoured_params(body)
    try:
        check_generation_params(body, None)  # min_tokens against max_tokens: GenerationService.max_tokens
    except ParamError as error:
        raise RequestError(str(error), param=error.field) from None
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = str(first["msg"]).removeprefix("Value error, ")
        raise RequestError(f"{param}: {message}" if param else message, param=param) from None
