"""How the canary's checks reach the environment's TLS listeners from the controller: the CA from SSL_CERT_FILE (or
its PEM text in PDSTACK_TLS_CA_PEM: the cloud's, read from SSM by inventories/aws) and, under the stack's mutual TLS
(serving.mutual_tls, where the decode servers and Prometheus admit only callers with a certificate from the
environment's CA), the operator's pair, which deploy.yml hands over in these variables."""

from __future__ import annotations

import os
import ssl

CLIENT_CERT_ENV = "PDSTACK_TLS_CLIENT_CERT"
CLIENT_KEY_ENV = "PDSTACK_TLS_CLIENT_KEY"
CA_PEM_ENV = "PDSTACK_TLS_CA_PEM"


def verify() -> ssl.SSLContext | bool:
    """httpx's `verify`: the default (SSL_CERT_FILE or the system's CAs) or the CA given as PEM, plus the operator's
    pair when it is given."""
    cert, ca_pem = os.environ.get(CLIENT_CERT_ENV), os.environ.get(CA_PEM_ENV)
    if not cert and not ca_pem:
        return True
    if ca_pem:
        context = ssl.create_default_context(cadata=ca_pem)
    else:
        context = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE"))
    if cert:
        context.load_cert_chain(cert, os.environ.get(CLIENT_KEY_ENV) or None)
    return context
