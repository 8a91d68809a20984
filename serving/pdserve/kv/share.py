"""The chunks of one multi-stream pull, handed to its streams one at a time as each stream is ready for more.

A static split (stream s of N carries plan[s::N]) makes a pull as slow as its slowest TCP flow: when one flow gets
less of the link than the others, the others finish early and leave the link part idle while it drains its share.
Here every stream of a pull takes the next chunk of one shared plan when it has sent its last one, so a faster flow
carries more chunks and all streams end within about one chunk of each other. (Each server socket also has a small
TCP_NOTSENT_LOWAT, so "sent" means "nearly on the wire", not "queued in a large send buffer".)

The streams of a pull are separate authenticated connections; they find each other by the pull id the client puts
in every stream's PULL (a fresh random id per pull, so a repeated pull of the same KV is served in full again).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pdserve.kv.entry import StoredKV
from pdserve.kv.errors import KVTransferError
from pdserve.kv.protocol import Chunk

ShareKey = tuple[str, str, int, int]  # request id, pull id, streams, first row


@dataclass
class SharedPlan:
    """One pull's chunks not yet taken (in plan order) and which of its streams are serving them."""

    stored: StoredKV
    untaken: list[Chunk]
    streams: int
    created: float
    serving: set[int] = field(default_factory=set)
    left: set[int] = field(default_factory=set)  # streams that ended (sent END, or failed after taking chunks)
    taken: dict[int, int] = field(default_factory=dict)  # stream -> chunks it took
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, stream: int, ready: Callable[[Chunk], bool]) -> tuple[Chunk | None, bool]:
        """The first chunk not taken yet that is `ready` (prefill has added its bytes), now stream `stream`'s, or
        None; and whether any chunk was left to take. A whole blob's first untaken chunk is always ready; a streamed
        blob's pieces may come in another order than the plan's (chunked prefill: every layer of each prompt
        chunk in turn)."""
        with self.lock:
            for index, chunk in enumerate(self.untaken):
                if ready(chunk):
                    del self.untaken[index]
                    self.taken[stream] = self.taken.get(stream, 0) + 1
                    return chunk, True
            return None, bool(self.untaken)

    def any_ready(self, ready: Callable[[Chunk], bool]) -> bool:
        with self.lock:
            return any(ready(chunk) for chunk in self.untaken)


class PullShares:
    """The shared plans of the pulls a KV server is serving, by pull id. A plan goes once each of its streams has
    ended, or `ttl_s` after it was made (a stream that never came: its client gave up long before)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._plans: dict[ShareKey, SharedPlan] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)

    @contextlib.contextmanager
    def join(
        self, key: ShareKey, stream: int, stored: StoredKV, make_plan: Callable[[], list[Chunk]]
    ) -> Iterator[SharedPlan]:
        """Serve stream `stream` of the pull `key` from its shared plan (made with `make_plan` by its first stream)."""
        shared = self._enter(key, stream, stored, make_plan)
        ended = False
        try:
            yield shared
            ended = True
        finally:
            self._leave(key, shared, stream, ended or shared.taken.get(stream, 0) > 0)

    def _enter(self, key: ShareKey, stream: int, stored: StoredKV, make_plan: Callable[[], list[Chunk]]) -> SharedPlan:
        now = self._clock()
        with self._lock:
            for stale in [k for k, plan in self._plans.items() if plan.created + self._ttl <= now]:
                del self._plans[stale]
            shared = self._plans.get(key)
            if shared is None:
                shared = self._plans[key] = SharedPlan(stored, make_plan(), key[2], now)
            elif shared.stored is not stored:
                raise KVTransferError(
                    "protocol", f"the KV of request {key[0]!r} was replaced while pull {key[1]!r} was under way"
                )
            if stream in shared.serving or stream in shared.left:
                raise KVTransferError("protocol", f"pull {key[1]!r} already has a stream {stream}")
            shared.serving.add(stream)
            return shared

    def _leave(self, key: ShareKey, shared: SharedPlan, stream: int, ended: bool) -> None:
        """A stream that failed before it took any chunk may come again (a client retrying a stale connection)."""
        with self._lock:
            shared.serving.discard(stream)
            if ended:
                shared.left.add(stream)
            if len(shared.left) >= shared.streams and self._plans.get(key) is shared:
                del self._plans[key]
