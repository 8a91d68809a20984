"""`POST /v1/kv/release` on prefill: free a KV lease at once when no decode will pull it.

The gateway calls it when decode refused the request, or the client left before decode started, so that the KV
does not sit in the lease store for the whole lease (`kv_lease_seconds`) and count against `kv_store_bytes`. Only a
caller holding the server API token gets here (the bearer middleware), and a lease is named by its
remote_request_id, which prefill generated and handed only to the gateway.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.server.openai_api import error_response, json_body
from pdserve.server.schemas import RequestError

RELEASE_PATH = "/v1/kv/release"
MAX_ID_CHARS = 256


async def release_kv(request: Request) -> Response:
    state = request.app.state.server
    exporter = state.exporter
    if exporter is None:
        return error_response(404, "path: this server holds no KV leases (only prefill does)", "not_found", "path")
    try:
        body = await json_body(request, state.settings.max_body_bytes)
    except RequestError as error:
        return error_response(error.status, error.message, error.kind, error.param)
    if not isinstance(body, dict):
        return error_response(400, "body: must be a JSON object", "invalid_request_error", "body")
    request_id = body.get("remote_request_id")
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= MAX_ID_CHARS:
        message = f"remote_request_id: required, a string of 1 to {MAX_ID_CHARS} characters"
        return error_response(400, message, "invalid_request_error", "remote_request_id")
    released = exporter.store.ack(request_id)
    state.metrics.kv_unused.labels("released" if released else "not_held").inc()
    return JSONResponse({"remote_request_id": request_id, "released": released})
