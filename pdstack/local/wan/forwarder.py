"""Moves packets between two TUN file descriptors, each direction shaped by a LinkDirection."""

from __future__ import annotations

import os
import random
import selectors
import time
from collections import deque
from collections.abc import Callable

from pdstack.local.wan.shape import LinkDirection, LinkShape

READ_BYTES = 65536


class Forwarder:
    """Moves packets between two TUN file descriptors through a LinkDirection each way."""

    def __init__(self, fd_a: int, fd_b: int, spec: LinkShape, seed: int | None = None) -> None:
        rng = random.Random(seed)  # noqa: S311 -- emulated packet loss, not cryptography
        self._fds = (fd_a, fd_b)
        self.directions = (LinkDirection(spec, rng), LinkDirection(spec, rng))
        # Packets leave in arrival order (the delay is the same for all of them, and set_spec keeps the order after a
        # change), so a FIFO per direction suffices.
        self._in_flight: tuple[deque[tuple[float, bytes]], deque[tuple[float, bytes]]] = (deque(), deque())
        self._stopping = False
        self._reload_requested = False

    @property
    def spec(self) -> LinkShape:
        return self.directions[0].spec

    def set_spec(self, spec: LinkShape) -> None:
        """Shape the packets that arrive from now on by `spec`. Packets in flight keep their delivery times, and no
        packet overtakes an older one: after a delay cut, new packets leave as soon as the older ones are out."""
        for direction in self.directions:
            direction.spec = spec

    def stop(self) -> None:
        self._stopping = True

    def request_reload(self) -> None:
        self._reload_requested = True

    def run(
        self,
        clock: Callable[[], float] = time.monotonic,
        wake_fd: int | None = None,
        on_reload: Callable[[], None] = lambda: None,
    ) -> None:
        """Forward until stop(). A byte on `wake_fd` (the signal wakeup pipe) ends a wait early, so a stop or a
        reload requested from a signal handler is acted on at once; `on_reload` runs between packets, never inside."""
        with selectors.DefaultSelector() as selector:
            for index, fd in enumerate(self._fds):
                selector.register(fd, selectors.EVENT_READ, index)
            if wake_fd is not None:
                selector.register(wake_fd, selectors.EVENT_READ, None)
            while not self._stopping:
                for key, _events in selector.select(self._wait_s(clock())):
                    if key.data is None:
                        _drain(key.fd)
                    else:
                        self._receive(key.data, clock)
                if self._reload_requested:
                    self._reload_requested = False
                    on_reload()
                self._deliver_due(clock())

    def _wait_s(self, now: float) -> float:
        due = [queue[0][0] for queue in self._in_flight if queue]
        return max(0.0, min(due) - now) if due else 0.5

    def _receive(self, source: int, clock: Callable[[], float]) -> None:
        while True:
            try:
                packet = os.read(self._fds[source], READ_BYTES)
            except BlockingIOError:
                return
            deliver_at = self.directions[source].schedule(clock(), len(packet))
            if deliver_at is not None:
                self._in_flight[source].append((deliver_at, packet))

    def _deliver_due(self, now: float) -> None:
        for source, queue in enumerate(self._in_flight):
            target = self._fds[1 - source]
            while queue and queue[0][0] <= now:
                _deliver_at, packet = queue.popleft()
                try:
                    os.write(target, packet)
                except OSError:
                    self.directions[source].stats.dropped_queue += 1  # the receiving kernel refused it


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
