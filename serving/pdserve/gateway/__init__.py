"""pdserve gateway: OpenAI-compatible entry point; auth, per-tenant limits, validation, prefill -> decode orchestration.

Run it with `pdserve gateway --scheduler-url URL --scheduler-token-file T --server-token-file S --api-keys-file FILE`
(or `python -m pdserve.gateway`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pdserve.common.logs import configure
from pdserve.common.tracing import configure_tracing, instrument_app
from pdserve.listener import serve
from pdserve.scheduler.settings import load_settings

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
    except (KeysFileError, ParamsKeyError) as exc:
        sys.exit(f"pdserve gateway: {exc}")
    serve(instrument_app(app), settings.host, settings.port, log_level=settings.log_level, graceful_shutdown_seconds=30)
