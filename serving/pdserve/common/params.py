"""Generation parameters checked the same way by the gateway and the model servers.

The gateway runs these checks before prefill, so that a request decode would refuse costs no prefill and no KV
lease; the servers run them again for callers that reach them directly. Only what every engine refuses is here
(vLLM refuses the same types and bounds): what pdserve's own engine does not honour is refused by pdserve's server.

Stop strings are bounded in number and in length because a server matches them against the generated text at every
token, on the engine's thread that every running request shares.
"""

from __future__ import annotations

from typing import Any

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256


class ParamError(ValueError):
    """A parameter no engine would accept; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def check_generation_params(body: dict[str, Any], max_tokens: int | None) -> None:
    """Raise ParamError for the first bad generation parameter of `body`; `max_tokens` is the request's cap
    (None when not known yet), which min_tokens may not exceed."""
    check_stop(body.get("stop"))
    _check_optional(body, "stop_token_ids", _is_int_list, "must be a list of integer token ids")
    _check_optional(body, "top_k", lambda v: _is_int(v) and v >= -1, "must be an integer >= -1 (-1 or 0: off)")
    for flag in ("ignore_eos", "return_token_ids", "echo"):
        _check_optional(body, flag, lambda v: isinstance(v, bool), "must be true or false")
    _check_stream_options(body.get("stream_options"))
    _check_min_tokens(body.get("min_tokens"), max_tokens)


def check_stop(stop: Any) -> None:
    stops = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) for s in stops):
        raise ParamError("stop", f"must be a string or a list of at most {MAX_STOP_SEQUENCES} strings")
    for stop_string in stops:
        if not 1 <= len(stop_string) <= MAX_STOP_CHARS:
            raise ParamError("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")


def _check_optional(body: dict[str, Any], name: str, valid: Any, message: str) -> None:
    value = body.get(name)
    if value is not None and not valid(value):
        raise ParamError(name, message)


def _check_stream_options(options: Any) -> None:
    if options is None:
        return
    if not isinstance(options, dict):
        raise ParamError("stream_options", "must be an object")
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise ParamError(f"stream_options.{name}", "must be true or false")


def _check_min_tokens(value: Any, max_tokens: int | None) -> None:
    if value is None:
        return
    if not _is_int(value) or value < 0:
        raise ParamError("min_tokens", "must be an integer >= 0")
    if max_tokens is not None and value > max_tokens:
        raise ParamError("min_tokens", f"{value} is more than max_tokens ({max_tokens})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)
