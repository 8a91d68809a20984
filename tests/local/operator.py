"""The operator's TLS client for the local environment's internal listeners (the scheduler, the servers, Prometheus):
under the stack's mutual TLS they admit only callers with a certificate from the local CA, here the operator's pair
that `up` made (status ca_file, client_cert, client_key)."""

from __future__ import annotations

import ssl
from typing import Any


def operator_context(status: dict[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=status["ca_file"])
    context.load_cert_chain(status["client_cert"], status["client_key"])
    return context
