"""pdserve gateway: OpenAI-compatible entry point; auth, per-tenant limits, validation, prefill -> decode orchestration.

Run it with `pdserve gateway --scheduler-url URL --scheduler-token-file T --server-token-file S --api-keys-file FILE`
(or `python -m pdserve.gateway`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pdserve.common.logs import configure
from pdserve.common.settings import load_settings
from pdserve.common.tls import TLSFileError
from pdserve.common.tracing import configure_tracing
from pdserve.listener import serve_component

from .app import create_app
from .auth import KeysFileError
from .early import ParamsKeyError
from .settings import GatewaySettings


def main(argv: Sequence[str]) -> None:
    settings = load_settings(GatewaySettings, argv, prog="pdserve gateway")
    configure("gateway", settings.log_level)
    configure_tracing("gateway", settings)  # before the app's httpx client exists, so that it is instrumented
    try:
        app = create_app(settings)
    except (KeysFileError, ParamsKeyError, TLSFileError) as exc:
        sys.exit(f"pdserve gateway: {exc}")
    serve_component(app, settings, graceful_shutdown_seconds=30)
