"""Server-sent events: reading decode's stream, writing the client's, and the error event that ends a broken stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

DONE = "[DONE]"


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The data payload of each event in an SSE response, in order."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[6:] if line.startswith("data: ") else line[5:])
    if lines:
        yield "\n".join(lines)


def encode(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


def error_event(message: str, error_type: str, request_id: str) -> bytes:
    """An OpenAI-style error event followed by [DONE]; the official client raises APIError on it."""
    payload = {
        "error": {"message": f"{message} (request {request_id})", "type": error_type, "param": None, "code": 502}
    }
    return encode(json.dumps(payload)) + encode(DONE)


UNFINISHED = frozenset({"abort", "error"})
"""finish_reasons with which an engine gives a choice up (vLLM's: `abort` for a request aborted, e.g. by an engine
shutting down; `error` for one that failed, e.g. a KV load under the `fail` policy): not an answer to relay as one."""


def unfinished(data: str) -> str | None:
    """The finish_reason of a choice this event (or JSON answer) gives up, if it gives one up."""
    if '"abort"' not in data and '"error"' not in data:  # every token event passes here: parse only a candidate
        return None
    try:
        choices = json.loads(data).get("choices") or []
    except (ValueError, AttributeError):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("finish_reason") in UNFINISHED:
            return str(choice["finish_reason"])
    return None


def carries_token(data: str) -> bool:
    """Whether a decode event holds generated text (or ends a choice): what TTFT and inter-token latency time."""
    if data == DONE:
        return False
    try:
        choices = json.loads(data).get("choices") or []
    except (ValueError, AttributeError):
        return False
    for choice in choices:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text or choice.get("finish_reason"):
            return True
    return False


def kv_stats(data: str) -> dict[str, Any] | None:
    """The `kv_transfer_stats` decode attaches to a chunk or body, if this one carries them."""
    if '"kv_transfer_stats"' not in data:
        return None
    try:
        stats = json.loads(data).get("kv_transfer_stats")
    except (ValueError, AttributeError):
        return None
    return stats if isinstance(stats, dict) else None
