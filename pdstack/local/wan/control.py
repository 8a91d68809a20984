"""Run-time changes of a running link: a control file the forwarder re-reads on SIGHUP, and the state it publishes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from pdstack.local.procs import alive
from pdstack.local.wan.shape import LinkShape

CONTROL_FIELDS = ("rate_mbit", "rtt_ms", "loss_pct")  # what a control file may change


@dataclass(frozen=True)
class LinkState:
    """What a running forwarder publishes: its pid, how many reloads it has done, the spec in force, and why the last
    control file was rejected (None when it was applied)."""

    pid: int
    reloads: int
    spec: LinkShape
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps({"pid": self.pid, "reloads": self.reloads, "spec": asdict(self.spec), "error": self.error})

    @classmethod
    def from_json(cls, text: str) -> LinkState:
        fields = json.loads(text)
        return cls(fields["pid"], fields["reloads"], LinkShape(**fields["spec"]), fields["error"])


def state_path(control_file: Path) -> Path:
    return control_file.with_name(control_file.name + ".state")


def changed_spec(spec: LinkShape, changes: object) -> LinkShape:
    """`spec` with a control file's `changes` applied and checked by LinkShape; a ValueError names what is wrong."""
    if not isinstance(changes, dict):
        raise ValueError(f"expected a JSON object with some of {', '.join(CONTROL_FIELDS)}, got {changes!r}")
    unknown = sorted(set(changes) - set(CONTROL_FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (a control file may set {', '.join(CONTROL_FIELDS)})")
    for name, value in changes.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: must be a number, got {value!r}")
    merged = {name: float(changes.get(name, getattr(spec, name))) for name in CONTROL_FIELDS}
    return LinkShape(merged["rate_mbit"], merged["rtt_ms"], merged["loss_pct"], spec.queue_bytes)


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(text)
    os.replace(staging, path)


class LinkControl:
    """The forwarder's end of run-time changes: applies the control file on request and publishes the outcome."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reloads = 0

    def publish(self, spec: LinkShape, error: str | None = None) -> None:
        try:
            _write_atomically(state_path(self.path), LinkState(os.getpid(), self.reloads, spec, error).to_json())
        except OSError as failure:  # the link goes on without its state file rather than stop
            print(f"wanlink: cannot publish the link state: {failure}", file=sys.stderr, flush=True)

    def reload(self, spec: LinkShape) -> LinkShape:
        """The spec the control file asks for; `spec` itself, with the reason on stderr, when the file is bad."""
        self.reloads += 1
        try:
            new = changed_spec(spec, json.loads(self.path.read_text()))
        except (OSError, ValueError, RecursionError) as error:  # a JSON syntax error is a ValueError
            reason = f"control file {self.path}: {error}"
            print(f"wanlink: {reason}; keeping {spec.describe()}", file=sys.stderr, flush=True)
            self.publish(spec, reason)
            return spec
        print(f"wanlink: reload {self.reloads}: {new.describe()}", file=sys.stderr, flush=True)
        self.publish(new)
        return new


def read_state(pid: int, control_file: Path) -> LinkState:
    """The state forwarder `pid` published next to `control_file`; RuntimeError when it published none."""
    try:
        state = LinkState.from_json(state_path(control_file).read_text())
    except FileNotFoundError:
        state = None
    if state is None or state.pid != pid:
        raise RuntimeError(f"forwarder {pid} publishes no state in {state_path(control_file)}")
    return state


def reload_link(pid: int, control_file: Path, timeout_s: float = 10.0) -> LinkState:
    """Send forwarder `pid` a SIGHUP and wait until it has published the outcome of that reload."""
    before = read_state(pid, control_file).reloads
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout_s
    while True:
        state = read_state(pid, control_file) if alive(pid) else None
        if state is None:
            raise RuntimeError(f"forwarder {pid} exited")
        if state.reloads > before:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"forwarder {pid} did not confirm the reload within {timeout_s:g} s")
        time.sleep(0.02)


def change_link(pid: int, control_file: Path, changes: dict[str, float], timeout_s: float = 10.0) -> LinkShape:
    """Change the running forwarder `pid`'s spec (fields of CONTROL_FIELDS); returns the spec it confirms.

    Values are checked before anything is sent: a ValueError names the bad field and the link stays as it was.
    Concurrent changes of one link are queued (a lock beside the control file), so none is lost.
    """
    with _exclusive(control_file.with_name(control_file.name + ".lock")):
        wanted = changed_spec(read_state(pid, control_file).spec, changes)
        _write_atomically(control_file, json.dumps({name: getattr(wanted, name) for name in CONTROL_FIELDS}))
        state = reload_link(pid, control_file, timeout_s)
    if state.error is not None:
        raise RuntimeError(f"forwarder {pid} kept {state.spec.describe()}: {state.error}")
    if state.spec != wanted:
        raise RuntimeError(
            f"forwarder {pid} applied {state.spec.describe()}, not {wanted.describe()} (a concurrent change?)"
        )
    return state.spec


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield
