"""A KV server process holding one synthetic blob, for tests that kill a real server mid-transfer or flood it.

Usage: python synthetic_server.py KEY_FILE REQUEST_ID MIB [--tls CERT KEY] [--drop-log-seconds S]
[--handshake-timeout S]. Prints "PORT CHECKSUM METRICS_PORT" once listening (its Prometheus metrics are served on
127.0.0.1:METRICS_PORT); logs warnings to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl

from kvtestlib import make_layers, meta_for
from prometheus_client import CollectorRegistry, start_http_server

from pdserve.kv import KVMetrics, KVServer, LeaseStore, SecretKey
from pdserve.kv.admission import KVListenerSettings


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("key_file")
    parser.add_argument("request_id")
    parser.add_argument("mib", type=int)
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    parser.add_argument("--drop-log-seconds", type=float)
    parser.add_argument("--handshake-timeout", type=float)
    return parser.parse_args()


def listener_settings(args: argparse.Namespace) -> KVListenerSettings:
    given = {"kv_drop_log_seconds": args.drop_log_seconds, "kv_handshake_timeout_seconds": args.handshake_timeout}
    return KVListenerSettings(**{name: value for name, value in given.items() if value is not None})


async def main(args: argparse.Namespace) -> None:
    registry = CollectorRegistry()
    metrics = KVMetrics(registry)
    store = LeaseStore(capacity_bytes=(args.mib + 1) << 20, metrics=metrics)
    layers = make_layers(8, (args.mib << 20) // 16 // 4, "float32")
    stored = store.put(args.request_id, layers, meta_for(args.request_id))
    tls = None
    if args.tls:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(*args.tls)
    server = KVServer(
        store, SecretKey.from_file(args.key_file), ssl_context=tls, limits=listener_settings(args), metrics=metrics
    )
    await server.start()
    http, _thread = start_http_server(0, "127.0.0.1", registry)
    print(server.port, stored.checksum, http.server_port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    asyncio.run(main(arguments()))
