"""A KV server process holding one synthetic blob, for tests that kill a real server mid-transfer.

Usage: python synthetic_server.py KEY_FILE REQUEST_ID MIB. Prints "PORT CHECKSUM" once listening.
"""

from __future__ import annotations

import asyncio
import sys

from kvtestlib import make_layers, meta_for
from prometheus_client import CollectorRegistry

from pdserve.kv import KVMetrics, KVServer, LeaseStore, SecretKey


async def main(key_file: str, request_id: str, mib: int) -> None:
    metrics = KVMetrics(CollectorRegistry())
    store = LeaseStore(capacity_bytes=(mib + 1) << 20, metrics=metrics)
    stored = store.put(request_id, make_layers(8, (mib << 20) // 16 // 4, "float32"), meta_for(request_id))
    server = KVServer(store, SecretKey.from_file(key_file), metrics=metrics)
    await server.start()
    print(server.port, stored.checksum, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
