"""The KV channel: prefill holds KV under leases and serves it; decode pulls it over parallel, verified streams."""

from pdserve.kv.auth import SecretKey
from pdserve.kv.blob import KVBlob, KVMeta, Layer
from pdserve.kv.client import KVConnectionPool, ack, pull
from pdserve.kv.entry import StoredKV
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.server import KVServer
from pdserve.kv.store import LeaseStore

__all__ = [
    "KVBlob",
    "KVConnectionPool",
    "KVMeta",
    "KVMetrics",
    "KVServer",
    "KVTransferError",
    "Layer",
    "LeaseStore",
    "SecretKey",
    "StoredKV",
    "ack",
    "default_metrics",
    "pull",
]
