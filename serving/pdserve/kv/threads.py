"""The KV client's thread pools, shared by every pull and ack of the process: stream threads run one stream's
blocking socket calls each (and connects), verify threads hash digest units as they land."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

STREAM_THREADS = 256  # stream and connect threads, over all pulls of the process
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _threads(name: str, workers: int) -> ThreadPoolExecutor:
    with _pools_lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"pdstack-kv-{name}")
        return _pools[name]


def stream_threads() -> ThreadPoolExecutor:
    return _threads("stream", STREAM_THREADS)


def verify_threads() -> ThreadPoolExecutor:
    return _threads("verify", os.cpu_count() or 2)
