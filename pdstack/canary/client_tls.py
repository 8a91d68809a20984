"""How the canary's checks reach the environment's TLS listeners from the controller: the CA from SSL_CERT_FILE and,
under the stack's mutual TLS (serving.mutual_tls, where the decode servers and Prometheus admit only callers with a
certificate from the environment's CA), the operator's pair, which deploy.yml hands over in these variables."""

from __future__ import annotations

import os
import ssl

CLIENT_CERT_ENV = "PDSTACK_TLS_CLIENT_CERT"
CLIENT_KEY_ENV = "PDSTACK_TLS_CLIENT_KEY"


def verify() -> ssl.SSLContext | bool:
    """httpx's `verify`: the default (SSL_CERT_FILE or the system's CAs), plus the operator's pair when it is given."""
    cert = os.environ.get(CLIENT_CERT_ENV)
    if not cert:
        return True
    context = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE"))
    context.load_cert_chain(cert, os.environ.get(CLIENT_KEY_ENV) or None)
    return context
