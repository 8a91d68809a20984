"""Request validation: OpenAI request bodies checked against bounds, every failure naming the field at fault."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .settings import GatewaySettings

Endpoint = Literal["completions", "chat"]
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer"}
MAX_STOP_SEQUENCES = 4


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
            return len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else \
                self.count_text(prompt if isinstance(prompt, str) else prompt[0])
        per_message_overhead = 4  # role markers of a chat template
        return sum(self.count_text(_content_text(m.get("content"))) + per_message_overhead for m in body["messages"])


def parse_body(raw: bytes, settings: GatewaySettings) -> dict[str, Any]:
    if len(raw) > settings.max_body_bytes:
        raise RequestError("body", f"request body of {len(raw)} bytes exceeds {settings.max_body_bytes}", status=413)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError("body", f"not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    return body


def validate(endpoint: Endpoint, body: dict[str, Any], settings: GatewaySettings,
             counter: PromptCounter) -> ValidRequest:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestError("model", "required, a non-empty string")
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
    max_tokens = _max_tokens(endpoint, body, settings)
    prompt_tokens = counter.count(endpoint, body)
    if prompt_tokens > settings.max_prompt_tokens:
        field = "prompt" if endpoint == "completions" else "messages"
        raise RequestError(field, f"prompt of {prompt_tokens} tokens exceeds the limit of {settings.max_prompt_tokens}")
    return ValidRequest(endpoint, body, prompt_tokens, max_tokens, stream)


def _max_tokens(endpoint: Endpoint, body: dict[str, Any], settings: GatewaySettings) -> int:
    name = "max_completion_tokens" if endpoint == "chat" and "max_completion_tokens" in body else "max_tokens"
    value = body.get(name)
    if value is None:
        body["max_tokens"] = value = settings.default_max_tokens
    if not _is_int(value) or not 1 <= value <= settings.max_tokens_limit:
        raise RequestError(name, f"must be an integer from 1 to {settings.max_tokens_limit}, got {value!r}")
    return int(value)


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
        if message.get("role") not in CHAT_ROLES:
            raise RequestError(f"messages[{index}].role", f"must be one of {sorted(CHAT_ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not _is_text_parts(content):
            raise RequestError(f"messages[{index}].content", "must be a string or a list of text parts")


def _check_sampling(body: dict[str, Any]) -> None:
    bounds = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
              "frequency_penalty": (-2.0, 2.0)}
    for name, (low, high) in bounds.items():
        value = body.get(name)
        if value is None:
            continue
        if not _is_number(value) or not low <= value <= high or (name == "top_p" and value == 0):
            raise RequestError(name, f"must be a number in [{low}, {high}]" + (" above 0" if name == "top_p" else ""))
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise RequestError("n", "only n=1 is supported")
    if "seed" in body and body["seed"] is not None and not _is_int(body["seed"]):
        raise RequestError("seed", "must be an integer")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and len(stop) <= MAX_STOP_SEQUENCES and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop", f"must be a string or a list of at most {MAX_STOP_SEQUENCES} strings")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_text_parts(content: Any) -> bool:
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)
