"""Waits on a KV connection's thread: the lease store's watches bind to an event loop, and a connection thread
(pdserve.kv.server) has none, so each gets a small one of its own, made on first use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from pdserve.kv.entry import StoredKV, Watch
from pdserve.kv.store import LeaseStore


class ThreadWaits:
    """A connection thread's own event loop, made on first use, on which it waits for lease store watches."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def watch(self, source: LeaseStore | StoredKV) -> Iterator[Watch]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        with self._loop.run_until_complete(_make_watch(source)) as watch:
            yield watch

    def wait(self, watch: Watch, timeout: float) -> bool:
        assert self._loop is not None
        return self._loop.run_until_complete(watch.wait(timeout))

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()


async def _make_watch(source: LeaseStore | StoredKV) -> Watch:
    return source.watch()  # a Watch binds to the running loop
