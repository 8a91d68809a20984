"""The lease release every prefill answers: `POST /v1/kv/release` with `{"remote_request_id": <lease>}`, answered
`{"remote_request_id": <lease>, "released": <whether it was still held>}`.

The gateway calls it when decode refused a request or the client left before decode started, so that KV no decode
will pull does not sit in prefill's lease store for the whole lease. pdserve's prefill serves it beside its API
(pdserve.server.leases); a vLLM prefill through PdstackConnector's API-server middleware (pdserve.vllm.release). Only
a caller holding the server's API token gets there, and a lease is named by the remote_request_id prefill handed to
the gateway alone.
"""

from __future__ import annotations

from typing import Any

from pdserve import jsonbody

RELEASE_PATH = "/v1/kv/release"
MAX_ID_CHARS = 256
MAX_BODY_BYTES = 4096  # `{"remote_request_id": ...}` with the longest id fits many times over


def lease_to_release(body: Any) -> str:
    """The lease a parsed release body names; jsonbody.BodyError naming the field otherwise."""
    if not isinstance(body, dict):
        raise jsonbody.BodyError("body", "must be a JSON object")
    request_id = body.get("remote_request_id")
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_ID_CHARS:
        raise jsonbody.BodyError("remote_request_id", f"required, a string of 1 to {MAX_ID_CHARS} characters")
    return request_id


def answer(request_id: str, released: bool) -> dict[str, Any]:
    return {"remote_request_id": request_id, "released": released}
