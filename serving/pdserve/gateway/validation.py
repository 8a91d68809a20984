"""Request validation: OpenAI request bodies checked against bounds, every failure naming the field at fault."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdserve import jsonbody
from pdserve.common.params import ParamError, check_generation_params
from pdserve.scheduler.protocol import ENGINE_OPTIONAL_PARAMS, RoutedInstance

from .settings import GatewaySettings

Endpoint = Literal["completions", "chat"]
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
MAX_SEED = 2**63 - 1
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "best_of": 1,
    "repetition_penalty": 1,
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "parallel_tool_calls": True,
    "presence_penalty": 0,
    "frequency_penalty": 0,
}
"""Values of ENGINE_OPTIONAL_PARAMS that ask for nothing, so any backend honours them (besides null and empty)."""


class RequestError(ValueError):
    """A request the gateway refuses; `field` names the offending parameter."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.status = status


@dataclass
class ValidRequest:
    endpoint: Endpoint
    body: dict[str, Any]
    prompt_tokens: int
    max_tokens: int
    stream: bool
    max_tokens_field: str = "max_tokens"

    @property
    def prompt_field(self) -> str:
        return "prompt" if self.endpoint == "completions" else "messages"

    def prompt_text(self) -> str:
        if self.endpoint == "chat":
            return "\n".join(_content_text(m.get("content")) for m in self.body["messages"])
        prompt = self.body["prompt"]
        return prompt if isinstance(prompt, str) else json.dumps(prompt)


class PromptCounter:
    """Prompt length in tokens: exact with a tokenizer file, otherwise UTF-8 bytes / 4 (an upper-side estimate)."""

    def __init__(self, tokenizer_file: Path | None) -> None:
        self._tokenizer = None
        if tokenizer_file is not None:
            from tokenizers import Tokenizer  # noqa: PLC0415 - optional, only with a tokenizer file

            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))

    def count_text(self, text: str) -> int:
        if self._tokenizer is not None:
            return len(self._tokenizer.encode(text, add_special_tokens=False).ids)
        return math.ceil(len(text.encode()) / 4)

    def count(self, endpoint: Endpoint, body: dict[str, Any]) -> int:
        if endpoint == "completions":
            prompt = body["prompt"]
            return (
                len(prompt)
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
                else self.count_text(prompt if isinstance(prompt, str) else prompt[0])
            )
        per_message_overhead = 4  # role markers of a chat template
        return sum(self.count_text(_content_text(m.get("content"))) + per_message_overhead for m in body["messages"])


def parse_body(raw: bytes, settings: GatewaySettings) -> dict[str, Any]:
    if len(raw) > settings.max_body_bytes:
        raise RequestError("body", f"request body of {len(raw)} bytes exceeds {settings.max_body_bytes}", status=413)
    try:
        body = jsonbody.loads(raw)
    except jsonbody.BodyError as exc:
        raise RequestError(exc.field, exc.message) from None
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    return body


def validate(
    endpoint: Endpoint, body: dict[str, Any], settings: GatewaySettings, counter: PromptCounter
) -> ValidRequest:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestError("model", "required, a non-empty string")
    if "kv_transfer_params" in body:
        raise RequestError("kv_transfer_params", "set by the gateway, not by clients")
    if endpoint == "completions":
        _check_prompt(body.get("prompt"))
    else:
        _check_messages(body.get("messages"))
    _check_sampling(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", "must be true or false")
    if "stream_options" in body and (not stream or not isinstance(body["stream_options"], dict)):
        raise RequestError("stream_options", "allowed only with stream=true, and must be an object")
    name = "max_completion_tokens" if endpoint == "chat" and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _max_tokens(name, body, settings)
    try:  # what decode would refuse, refused before prefill runs
        check_generation_params(body, max_tokens)
    except ParamError as exc:
        raise RequestError(exc.field, exc.message) from None
    prompt_tokens = counter.count(endpoint, body)
    valid = ValidRequest(endpoint, body, prompt_tokens, max_tokens, stream, name)
    if prompt_tokens > settings.max_prompt_tokens:
        raise RequestError(
            valid.prompt_field, f"prompt of {prompt_tokens} tokens exceeds the limit of {settings.max_prompt_tokens}"
        )
    return valid


def check_fleet(valid: ValidRequest, instances: list[RoutedInstance]) -> None:
    """Refuse what the ready instances would not honour: an engine-optional parameter not every one of them
    declares (it would be silently ignored), and a prompt past the smallest context (it would spend a prefill
    and a KV lease before decode refused it)."""
    for name in ENGINE_OPTIONAL_PARAMS:
        if asks_for_something(name, valid.body.get(name)) and not all(
            name in i.info.supported_params for i in instances
        ):
            raise RequestError(name, "not supported by the serving engine (no ready instance declares it)")
    limits = [i.info.max_model_len for i in instances if i.info.max_model_len is not None]
    if not limits:
        return
    context = min(limits)
    if valid.prompt_tokens >= context:
        raise RequestError(
            valid.prompt_field, f"prompt of {valid.prompt_tokens} tokens does not fit the model's context of {context}"
        )
    if valid.prompt_tokens + valid.max_tokens > context:
        field = valid.max_tokens_field
        raise RequestError(
            field,
            f"prompt ({valid.prompt_tokens} tokens) plus {field} ({valid.max_tokens}) exceeds "
            f"the model's context of {context}",
        )


def asks_for_something(name: str, value: Any) -> bool:
    """Whether `value` of the engine-optional parameter `name` asks the engine to do something."""
    if value is None or value in ({}, [], ""):
        return False
    default = OPTIONAL_DEFAULTS.get(name)
    if isinstance(value, bool) != isinstance(default, bool):  # best_of: true is not best_of 1
        return True
    return default is None or value != default


def _max_tokens(name: str, body: dict[str, Any], settings: GatewaySettings) -> int:
    value = body.get(name)
    if value is None:
        body["max_tokens"] = value = settings.default_max_tokens
    if not _is_int(value) or not 1 <= value <= settings.max_output_tokens:
        raise RequestError(name, f"must be an integer from 1 to {settings.max_output_tokens}, got {_shown(value)}")
    return int(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) and prompt[0]:
        return
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return
    raise RequestError("prompt", "required: a non-empty string, a list of one string, or a list of token ids")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "required: a non-empty list of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{index}]", "must be an object with role and content")
        if not isinstance(message.get("role"), str) or message["role"] not in CHAT_ROLES:
            raise RequestError(f"messages[{index}].role", f"must be one of {sorted(CHAT_ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not _is_text_parts(content):
            raise RequestError(f"messages[{index}].content", "must be a string or a list of text parts")


def _check_sampling(body: dict[str, Any]) -> None:
    bounds = {
        "temperature": (0.0, 2.0),
        "top_p": (0.0, 1.0),
        "presence_penalty": (-2.0, 2.0),
        "frequency_penalty": (-2.0, 2.0),
    }
    for name, (low, high) in bounds.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value) or not low <= value <= high or (name == "top_p" and value == 0):
            raise RequestError(name, f"must be a number in [{low}, {high}]" + (" above 0" if name == "top_p" else ""))
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise RequestError("n", "only n=1 is supported")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise RequestError("seed", f"must be an integer from 0 to {MAX_SEED}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_text_parts(content: Any) -> bool:
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    )


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)
