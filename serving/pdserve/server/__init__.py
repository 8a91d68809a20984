"""pdserve's HTTP servers: prefill, decode and colocated roles sharing one app factory.

Files, one concern each:
  settings.py     typed configuration (flags and PDSERVE_* variables: pdserve.common.settings)
  auth.py         the API bearer token (--api-token-file), checked before a request's body is read
  schemas.py      OpenAI request bodies and vLLM's kv_transfer_params; what is refused by name
  batching.py     continuous batching with length-bucketed chunked prefill; admission limits
  kvlink.py       prefill's KV export (lease store + KV server, signed params) and decode's verified import
  generation.py   request -> admitted sequence -> tokens, per role
  openai_api.py   /v1/completions, /v1/chat/completions (JSON and SSE), /v1/models
  metrics.py      Prometheus metrics (pdserve_*)
  heartbeat.py    registration with the scheduler
  app.py          the Starlette app and its lifespan
"""

from pdserve.server.app import create_app
from pdserve.server.settings import FailurePolicy, Role, ServerSettings

__all__ = ["FailurePolicy", "Role", "ServerSettings", "create_app"]
