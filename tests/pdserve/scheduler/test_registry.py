"""The registry's state machine under a stalled instance, on a controlled clock."""

from __future__ import annotations

from pdserve.scheduler.protocol import InstanceInfo, InstanceLoad
from pdserve.scheduler.registry import Registry

INFO = InstanceInfo(instance_id="d1", role="decode", version="v1", kv_fingerprint="fp", url="http://127.0.0.1:9")


def test_a_drained_instance_that_stalls_comes_back_draining_not_ready() -> None:
    now = [0.0]
    registry = Registry(dead_after=3.0, forget_after=300.0, clock=lambda: now[0])
    registry.register(INFO)
    registry.heartbeat("d1", InstanceLoad(ready=True))
    registry.drain("d1")
    now[0] = 10.0  # a CPU stall: heartbeats missed, the instance is declared dead ...
    registry.sweep()
    assert [i.state for i in registry.all()] == ["dead"]
    registry.heartbeat("d1", InstanceLoad(ready=True))  # ... then it heartbeats again
    assert [i.state for i in registry.all()] == ["draining"], "a drained instance must not be routed to again"
    # A new process under the same id (the release started again, e.g. by a rollback) starts afresh.
    registry.register(INFO)
    registry.heartbeat("d1", InstanceLoad(ready=True))
    assert [i.state for i in registry.all()] == ["ready"]


def test_an_instance_that_stalls_without_a_drain_comes_back_ready() -> None:
    now = [0.0]
    registry = Registry(dead_after=3.0, forget_after=300.0, clock=lambda: now[0])
    registry.register(INFO)
    now[0] = 10.0
    registry.sweep()
    registry.heartbeat("d1", InstanceLoad(ready=True))
    assert [i.state for i in registry.all()] == ["ready"]
