"""Request bodies as strict JSON, the same on every pdserve listener (gateway, servers, scheduler).

`json.loads` accepts what no field can mean: NaN and Infinity (and 1e999, which it reads as Infinity), strings and keys
with lone UTF-16 surrogates (no UTF-8 text holds them), and nesting deep enough to exhaust the stack. `loads` refuses
each with a BodyError naming the field (`messages[0].content`; `body` for the whole), so that a listener answers 400
instead of failing later with a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

MAX_DEPTH = 32  # OpenAI bodies nest a handful of levels (messages -> content parts -> fields)


class BodyError(ValueError):
    status = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class BodyTooLarge(BodyError):
    status = 413


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (BodyTooLarge, field `body`) as soon as it is known to exceed `limit` bytes: by
    its Content-Length before a byte is read, or while it streams in, so that no caller holds more than `limit`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge("body", f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge("body", f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def loads(raw: bytes) -> Any:
    """The parsed body; BodyError naming the field for anything above."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyError("body", f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # also bad UTF-8 and integers too long to convert
        raise BodyError("body", f"not valid JSON ({str(exc).split(':')[0]})") from None
    check_values(body)
    return body


def check_values(body: Any) -> None:
    """Iterative, so that a deep body cannot exhaust the stack here."""
    pending: list[tuple[Any, str, int]] = [(body, "", 0)]
    while pending:
        value, path, depth = pending.pop()
        field = path or "body"
        if isinstance(value, float) and not math.isfinite(value):
            raise BodyError(field, "must be a finite number (NaN, Infinity and 1e999 are not JSON numbers)")
        if isinstance(value, str) and not _is_text(value):
            raise BodyError(field, "contains a lone surrogate (\\ud800-\\udfff), not valid Unicode text")
        if isinstance(value, dict | list) and depth >= MAX_DEPTH:
            raise BodyError(field, f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            pending.extend((item, f"{path}[{index}]", depth + 1) for index, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key if _is_text(key) else key.encode("utf-8", "backslashreplace").decode()
                child = f"{path}.{name}" if path else name
                if name != key:
                    raise BodyError(child, "field name contains a lone surrogate, not valid Unicode text")
                pending.append((item, child, depth + 1))


def _is_text(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
