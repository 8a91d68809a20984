"""A local AWS API for tests: moto in server mode in a thread of the test process, on loopback, reached by real
boto3 clients over HTTP exactly as a node reaches AWS (`endpoint_url`), as the local environment's nodes will.

`moto_server()` starts one (a module- or session-scoped fixture holds it: starting takes a fraction of a second,
but a test should share it); `client(url, service, region)` makes a client on moto's fake credentials.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import boto3
from moto.server import ThreadedMotoServer

from tests.support.ports import free_port

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
ACCOUNT = "123456789012"  # moto's default account: ECR's token is AWS:<account>-auth-token


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto server on 127.0.0.1; its URL."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def client(url: str, service: str, region: str = "us-east-1") -> Any:
    return boto3.client(service, region_name=region, endpoint_url=url, **CREDENTIALS)
