"""The KV channel: prefill holds KV under leases and serves it; decode pulls it over parallel, verified streams.

Files, one concern each:
  protocol.py   frames and chunk plans
  wire.py       blocking frame I/O on one socket: read timeouts, and outwaiting a stalled but live peer
  auth.py       the shared key, the HMAC handshake, END's MAC
  blob.py       blobs, manifests, unit digests and the blob checksum
  entry.py      one leased blob, whole or being filled
  store.py      the lease store: memory bound, leases, watches
  share.py      the chunks a pull's streams share
  admission.py  the listener's slots before and after authentication (per address, oldest evicted), its limits
                (KVListenerSettings), and what it dropped: counted, logged at a bounded rate
  server.py     prefill's listener: accept, authenticate, dispatch
  sender.py     serving one pull stream
  client.py     decode's pull and ack
  connect.py    connecting: TLS, handshake, retries (`capacity` too, within capacity_wait_s), the stall bound
  pool.py       authenticated connections and their pool
  route.py      one request on a fresh or pooled connection
  assembly.py   what a pull receives, verified as it lands
  arrays.py     blob arrays, reused already faulted in
  threads.py    the client's thread pools
  params.py     signed kv_transfer_params
  metrics.py    Prometheus metrics
  errors.py     KVTransferError
"""

from pdserve.kv.auth import SecretKey
from pdserve.kv.blob import KVBlob, KVMeta, Layer
from pdserve.kv.client import ack, pull
from pdserve.kv.entry import StoredKV
from pdserve.kv.errors import KVTransferError
from pdserve.kv.metrics import KVMetrics, default_metrics
from pdserve.kv.pool import KVConnectionPool
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
