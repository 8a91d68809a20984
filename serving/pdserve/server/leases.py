"""`POST /v1/kv/release` on pdserve's prefill (the contract: pdserve.kv.release): free a KV lease at once when no
decode will pull it, counted by outcome in pdserve_kv_leases_unused_total. The bearer middleware lets only a caller
holding the server API token get here."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve import jsonbody
from pdserve.kv.release import MAX_BODY_BYTES, answer, lease_to_release
from pdserve.server.openai_api import error_response


async def release_kv(request: Request) -> Response:
    state = request.app.state.server
    exporter = state.exporter
    if exporter is None:
        return error_response(404, "path: this server holds no KV leases (only prefill does)", "not_found", "path")
    try:
        request_id = lease_to_release(jsonbody.loads(await jsonbody.read_body(request, MAX_BODY_BYTES)))
    except jsonbody.BodyError as error:
        return error_response(error.status, str(error), "invalid_request_error", error.field)
    released = exporter.store.ack(request_id)
    state.metrics.kv_unused.labels("released" if released else "not_held").inc()
    return JSONResponse(answer(request_id, released))
