"""The instance registry: registration, heartbeats, and the state machine starting -> ready -> draining -> dead."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .protocol import InstanceInfo, InstanceLoad, RoutedInstance, State

log = logging.getLogger(__name__)


class UnknownInstanceError(KeyError):
    """No instance with this id is registered (the scheduler may have restarted: register again)."""


@dataclass
class Instance:
    instance_id: str
    info: InstanceInfo
    state: State = "starting"
    load: InstanceLoad = field(default_factory=lambda: InstanceLoad(ready=False))
    last_seen: float = 0.0
    drained: bool = False
    """Drained once: this process stays draining, even when a stall had it declared dead, and is never ready again."""

    def routed(self) -> RoutedInstance:
        return RoutedInstance(instance_id=self.instance_id, state=self.state, info=self.info, load=self.load)


class Registry:
    """Instances by id; `generation` increases on every change so pollers can skip unchanged tables."""

    def __init__(
        self,
        dead_after: float,
        forget_after: float,
        on_transition: Callable[[State], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dead_after = dead_after
        self.forget_after = forget_after
        self.generation = 1
        self._instances: dict[str, Instance] = {}
        self._on_transition = on_transition
        self._clock = clock

    def register(self, info: InstanceInfo) -> Instance:
        instance_id = info.instance_id or f"{info.role}-{uuid.uuid4().hex[:12]}"
        # A registration is a new process (clients register again only when the scheduler forgot them): it starts
        # afresh even under the id of a drained one, e.g. the same release started again after a rollback.
        instance = Instance(instance_id, info.model_copy(update={"instance_id": instance_id}), last_seen=self._clock())
        self._instances[instance_id] = instance
        if self._on_transition is not None:
            self._on_transition(instance.state)
        self._changed()
        log.info(
            "instance registered",
            extra={"fields": {"instance_id": instance_id, "role": info.role, "version": info.version, "url": info.url}},
        )
        return instance

    def heartbeat(self, instance_id: str, load: InstanceLoad) -> Instance:
        instance = self._get(instance_id)
        instance.load = load
        instance.last_seen = self._clock()
        if instance.drained:
            self._set_state(instance, "draining")  # back from dead after a stall: still on its way out
        else:
            self._set_state(instance, "ready" if load.ready else "starting")
        self._changed()
        return instance

    def drain(self, instance_id: str) -> Instance:
        instance = self._get(instance_id)
        instance.drained = True
        self._set_state(instance, "draining")
        self._changed()
        return instance

    def remove(self, instance_id: str) -> None:
        self._get(instance_id)
        del self._instances[instance_id]
        self._changed()
        log.info("instance removed", extra={"fields": {"instance_id": instance_id}})

    def sweep(self) -> None:
        """Declare instances that stopped heartbeating dead, and forget long-dead ones."""
        now = self._clock()
        for instance in list(self._instances.values()):
            silent_for = now - instance.last_seen
            if instance.state != "dead" and silent_for > self.dead_after:
                self._set_state(instance, "dead")
                self._changed()
            elif instance.state == "dead" and silent_for > self.forget_after:
                del self._instances[instance.instance_id]
                self._changed()

    def all(self) -> list[Instance]:
        return sorted(self._instances.values(), key=lambda i: i.instance_id)

    def find(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def in_state(self, state: State) -> list[Instance]:
        return [i for i in self.all() if i.state == state]

    def _get(self, instance_id: str) -> Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise UnknownInstanceError(instance_id) from None

    def _set_state(self, instance: Instance, state: State) -> None:
        if instance.state == state:
            return
        log.info(
            "instance state",
            extra={"fields": {"instance_id": instance.instance_id, "from": instance.state, "to": state}},
        )
        instance.state = state
        if self._on_transition is not None:
            self._on_transition(state)

    def _changed(self) -> None:
        self.generation += 1
