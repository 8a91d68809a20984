"""An emulated WAN link between two network namespaces, in user space.

Kernels without `sch_netem` (like the CI machines) cannot add delay or loss with `tc`. This module emulates the link
instead: a TUN device is created for each side and moved into that side's network namespace (MTU 65000), and a
forwarder process moves each packet from one TUN to the other after its serialisation time at the link rate plus the
one-way delay (half the RTT). It drops a packet with the configured loss probability, and tail-drops when the queue
waiting for the serialiser exceeds the queue limit (by default one bandwidth-delay product), so TCP sees a real
bottleneck. Where the kernel has netem, `tc qdisc add dev DEV root netem delay .. loss .. rate ..` on a veth pair is
the simpler choice; this forwarder is the fallback design that works everywhere TUN does.

Like `tc qdisc change ... netem`, a running link can be reshaped: with `--control-file PATH`, the forwarder re-reads
PATH on SIGHUP (a JSON object with any of rate_mbit, rtt_ms, loss_pct; the rest stay as they are) and applies it to
the packets that arrive from then on, keeping its TUN devices and the packets in flight. It publishes the spec in force
in PATH.state (pid, reload count, spec, and the error when a file was rejected: a bad file never changes the spec).
`change_link` does all of that for a caller and returns once the forwarder confirms the new spec.

CLI:
    python -m pdstack.wanlink run --ns-a A --ns-b B --rate-mbit 1000 --rtt-ms 20 --loss-pct 0 [--control-file PATH]
    python -m pdstack.wanlink netns-add NAME | netns-del NAME
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import random
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Interface, IPv4Network
from pathlib import Path
from types import TracebackType
from typing import Any

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
TUN_MTU = 65000
READ_BYTES = 65536
DEFAULT_SUBNET = "10.203.0.0/24"
CONTROL_FIELDS = ("rate_mbit", "rtt_ms", "loss_pct")  # what a control file may change


@dataclass(frozen=True)
class LinkSpec:
    """The link's shape: rate, round-trip delay, random loss and queue size (bytes; None means one BDP)."""

    rate_mbit: float
    rtt_ms: float
    loss_pct: float = 0.0
    queue_bytes: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.rate_mbit < math.inf:
            raise ValueError(f"rate_mbit: must be a positive number, got {self.rate_mbit}")
        if not 0 <= self.rtt_ms < math.inf:
            raise ValueError(f"rtt_ms: must be a number, zero or more, got {self.rtt_ms}")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"loss_pct: must be in [0, 100), got {self.loss_pct}")
        if self.queue_bytes is not None and self.queue_bytes < TUN_MTU:
            raise ValueError(f"queue_bytes: must hold at least one {TUN_MTU}-byte packet, got {self.queue_bytes}")

    @property
    def bytes_per_second(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def one_way_delay_s(self) -> float:
        return self.rtt_ms / 2000

    @property
    def queue_limit_bytes(self) -> int:
        if self.queue_bytes is not None:
            return self.queue_bytes
        bdp = int(self.bytes_per_second * self.rtt_ms / 1000)
        return max(bdp, 2 * TUN_MTU)

    def describe(self) -> str:
        return f"rate {self.rate_mbit:g} Mbit/s, RTT {self.rtt_ms:g} ms, loss {self.loss_pct:g} %"


@dataclass
class DirectionStats:
    forwarded: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0


@dataclass
class LinkDirection:
    """One direction of the link: decides when each packet is delivered, or that it is dropped."""

    spec: LinkSpec
    rng: random.Random
    stats: DirectionStats = field(default_factory=DirectionStats)
    _serialiser_free_at: float = 0.0

    def schedule(self, now: float, size: int) -> float | None:
        """Delivery time of a packet of `size` bytes that arrives at `now`, or None if the link drops it."""
        free_at = max(now, self._serialiser_free_at)
        backlog_bytes = round((free_at - now) * self.spec.bytes_per_second)
        if backlog_bytes + size > self.spec.queue_limit_bytes:
            self.stats.dropped_queue += 1
            return None
        if self.spec.loss_pct and self.rng.random() * 100 < self.spec.loss_pct:
            self.stats.dropped_loss += 1
            return None
        self._serialiser_free_at = free_at + size / self.spec.bytes_per_second
        self.stats.forwarded += 1
        return self._serialiser_free_at + self.spec.one_way_delay_s


@dataclass(frozen=True)
class Endpoint:
    """One side of the link: the namespace, the TUN device's name there and its address (with prefix)."""

    namespace: str
    device: str
    address: IPv4Interface
    routes: tuple[IPv4Network, ...] = ()


class Forwarder:
    """Moves packets between two TUN file descriptors through a LinkDirection each way."""

    def __init__(self, fd_a: int, fd_b: int, spec: LinkSpec, seed: int | None = None) -> None:
        rng = random.Random(seed)  # noqa: S311 -- emulated packet loss, not cryptography
        self._fds = (fd_a, fd_b)
        self.directions = (LinkDirection(spec, rng), LinkDirection(spec, rng))
        # Packets leave in arrival order (the delay is the same for all of them, and set_spec keeps the order after a
        # change), so a FIFO per direction suffices.
        self._in_flight: tuple[deque[tuple[float, bytes]], deque[tuple[float, bytes]]] = (deque(), deque())
        self._stopping = False
        self._reload_requested = False

    @property
    def spec(self) -> LinkSpec:
        return self.directions[0].spec

    def set_spec(self, spec: LinkSpec) -> None:
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


# -- run-time changes ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkState:
    """What a running forwarder publishes: its pid, how many reloads it has done, the spec in force, and why the last
    control file was rejected (None when it was applied)."""

    pid: int
    reloads: int
    spec: LinkSpec
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps({"pid": self.pid, "reloads": self.reloads, "spec": asdict(self.spec), "error": self.error})

    @classmethod
    def from_json(cls, text: str) -> LinkState:
        fields = json.loads(text)
        return cls(fields["pid"], fields["reloads"], LinkSpec(**fields["spec"]), fields["error"])


def state_path(control_file: Path) -> Path:
    return control_file.with_name(control_file.name + ".state")


def changed_spec(spec: LinkSpec, changes: object) -> LinkSpec:
    """`spec` with a control file's `changes` applied and checked by LinkSpec; a ValueError names what is wrong."""
    if not isinstance(changes, dict):
        raise ValueError(f"expected a JSON object with some of {', '.join(CONTROL_FIELDS)}, got {changes!r}")
    unknown = sorted(set(changes) - set(CONTROL_FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (a control file may set {', '.join(CONTROL_FIELDS)})")
    for name, value in changes.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: must be a number, got {value!r}")
    merged = {name: float(changes.get(name, getattr(spec, name))) for name in CONTROL_FIELDS}
    return LinkSpec(merged["rate_mbit"], merged["rtt_ms"], merged["loss_pct"], spec.queue_bytes)


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(text)
    os.replace(staging, path)


class LinkControl:
    """The forwarder's end of run-time changes: applies the control file on request and publishes the outcome."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reloads = 0

    def publish(self, spec: LinkSpec, error: str | None = None) -> None:
        try:
            _write_atomically(state_path(self.path), LinkState(os.getpid(), self.reloads, spec, error).to_json())
        except OSError as failure:  # the link goes on without its state file rather than stop
            print(f"wanlink: cannot publish the link state: {failure}", file=sys.stderr, flush=True)

    def reload(self, spec: LinkSpec) -> LinkSpec:
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
        state = read_state(pid, control_file) if _alive(pid) else None
        if state is None:
            raise RuntimeError(f"forwarder {pid} exited")
        if state.reloads > before:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"forwarder {pid} did not confirm the reload within {timeout_s:g} s")
        time.sleep(0.02)


def change_link(pid: int, control_file: Path, changes: dict[str, float], timeout_s: float = 10.0) -> LinkSpec:
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


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# -- namespaces and TUN devices -----------------------------------------------------------------------------------


def run_ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def namespace_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def create_namespace(name: str) -> None:
    """Create a network namespace with its loopback up."""
    run_ip("netns", "add", name)
    run_ip("-n", name, "link", "set", "lo", "up")


def delete_namespace(name: str) -> None:
    if namespace_exists(name):
        run_ip("netns", "delete", name)


def open_tun(name: str) -> int:
    """Create a TUN device (deleted again when the returned descriptor closes)."""
    if len(name.encode()) > 15:
        raise ValueError(f"device name {name!r}: at most 15 bytes")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def attach(fd_name: str, endpoint: Endpoint) -> None:
    """Move a TUN device into its endpoint's namespace and give it its address and routes."""
    if not namespace_exists(endpoint.namespace):
        raise ValueError(f"namespace {endpoint.namespace!r} does not exist (create it with `ip netns add`)")
    run_ip("link", "set", fd_name, "netns", endpoint.namespace, "name", endpoint.device)
    run_ip("-n", endpoint.namespace, "link", "set", endpoint.device, "mtu", str(TUN_MTU), "up")
    run_ip("-n", endpoint.namespace, "addr", "add", str(endpoint.address), "dev", endpoint.device)
    for route in endpoint.routes:
        run_ip("-n", endpoint.namespace, "route", "replace", str(route), "dev", endpoint.device)


def serve_link(
    a: Endpoint,
    b: Endpoint,
    spec: LinkSpec,
    ready: Callable[[], None],
    *,
    seed: int | None = None,
    control_file: Path | None = None,
) -> None:
    """Create both TUN devices, join them to their namespaces and forward until SIGTERM or SIGINT; on SIGHUP, apply
    `control_file` (without one, SIGHUP is reported and ignored)."""
    staging = (f"wl{os.getpid()}a", f"wl{os.getpid()}b")
    fds = [open_tun(staging[0]), open_tun(staging[1])]
    forwarder = Forwarder(fds[0], fds[1], spec, seed)
    control = LinkControl(control_file) if control_file is not None else None

    def reload() -> None:
        if control is None:
            print("wanlink: SIGHUP ignored: started without --control-file", file=sys.stderr, flush=True)
        else:
            forwarder.set_spec(control.reload(forwarder.spec))

    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    handlers: dict[signal.Signals, Callable[[int, Any], None]] = {
        signal.SIGTERM: lambda _s, _f: forwarder.stop(),
        signal.SIGINT: lambda _s, _f: forwarder.stop(),
        signal.SIGHUP: lambda _s, _f: forwarder.request_reload(),
    }
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    previous_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    try:
        attach(staging[0], a)
        attach(staging[1], b)
        if control is not None:
            control.publish(spec)
        ready()
        forwarder.run(wake_fd=wake_read, on_reload=reload)
    finally:
        for fd in fds:
            os.close(fd)  # closing a non-persistent TUN removes the device, wherever it now lives
        signal.set_wakeup_fd(previous_wakeup)
        os.close(wake_read)
        os.close(wake_write)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    names = ("a_to_b", "b_to_a")
    stats = {name: asdict(direction.stats) for name, direction in zip(names, forwarder.directions, strict=True)}
    print(json.dumps({"stats": stats}), file=sys.stderr, flush=True)


class LinkProcess:
    """The link running as a child process (`python -m pdstack.wanlink run ...`); a context manager."""

    def __init__(
        self, a: Endpoint, b: Endpoint, spec: LinkSpec, seed: int | None = None, control_file: Path | None = None
    ) -> None:
        self.a, self.b, self.spec, self.control_file = a, b, spec, control_file
        self._argv = [sys.executable, "-m", "pdstack.wanlink", *link_arguments(a, b, spec, seed, control_file)]
        self._process: subprocess.Popen[str] | None = None
        self.stats: dict[str, dict[str, int]] = {}
        self.stderr = ""  # what the forwarder reported, once stopped

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the link is not running")
        return self._process.pid

    def state(self) -> LinkState:
        """The spec in force as the forwarder publishes it (needs a control file)."""
        return read_state(self.pid, self._control_file())

    def change(self, timeout_s: float = 10.0, **changes: float) -> LinkSpec:
        """Change the running link's rate_mbit, rtt_ms or loss_pct; returns the spec the forwarder confirms."""
        return change_link(self.pid, self._control_file(), changes, timeout_s)

    def _control_file(self) -> Path:
        if self.control_file is None:
            raise RuntimeError("the link was started without a control file")
        return self.control_file

    def start(self, timeout_s: float = 10.0) -> None:
        self._process = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self._process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s) or self._process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"WAN link did not come up: {self._error_output()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
        try:
            _out, err = self._process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            _out, err = self._process.communicate()
        self.stderr = err
        self.stats = _parse_stats(err)
        self._process = None

    def _error_output(self) -> str:
        if self._process is None or self._process.poll() is None:
            return "no ready line in time"
        assert self._process.stderr is not None
        return self._process.stderr.read().strip()

    def __enter__(self) -> LinkProcess:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def _parse_stats(stderr: str) -> dict[str, dict[str, int]]:
    for line in reversed(stderr.splitlines()):
        if line.startswith('{"stats"'):
            stats: dict[str, dict[str, int]] = json.loads(line)["stats"]
            return stats
    return {}


def link_arguments(
    a: Endpoint, b: Endpoint, spec: LinkSpec, seed: int | None = None, control_file: Path | None = None
) -> list[str]:
    argv = ["run", "--ns-a", a.namespace, "--ns-b", b.namespace, "--dev-a", a.device, "--dev-b", b.device,
            "--addr-a", str(a.address), "--addr-b", str(b.address), "--rate-mbit", str(spec.rate_mbit),
            "--rtt-ms", str(spec.rtt_ms), "--loss-pct", str(spec.loss_pct)]  # fmt: skip
    for flag, routes in (("--route-a", a.routes), ("--route-b", b.routes)):
        for route in routes:
            argv += [flag, str(route)]
    if spec.queue_bytes is not None:
        argv += ["--queue-bytes", str(spec.queue_bytes)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    if control_file is not None:
        argv += ["--control-file", str(control_file)]
    return argv


def default_endpoints(ns_a: str, ns_b: str, subnet: str = DEFAULT_SUBNET) -> tuple[Endpoint, Endpoint]:
    network = IPv4Network(subnet)
    hosts = network.hosts()
    first, second = next(hosts), next(hosts)
    return (
        Endpoint(ns_a, "wan0", IPv4Interface(f"{first}/{network.prefixlen}")),
        Endpoint(ns_b, "wan0", IPv4Interface(f"{second}/{network.prefixlen}")),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pdstack.wanlink", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="join two namespaces with an emulated link until SIGTERM")
    run.add_argument("--ns-a", required=True)
    run.add_argument("--ns-b", required=True)
    run.add_argument("--dev-a", default="wan0")
    run.add_argument("--dev-b", default="wan0")
    run.add_argument("--addr-a", type=IPv4Interface, default=IPv4Interface("10.203.0.1/24"))
    run.add_argument("--addr-b", type=IPv4Interface, default=IPv4Interface("10.203.0.2/24"))
    run.add_argument("--route-a", type=IPv4Network, action="append", default=[], help="prefix A reaches via the link")
    run.add_argument("--route-b", type=IPv4Network, action="append", default=[], help="prefix B reaches via the link")
    run.add_argument("--rate-mbit", type=float, required=True)
    run.add_argument("--rtt-ms", type=float, required=True)
    run.add_argument("--loss-pct", type=float, default=0.0)
    run.add_argument("--queue-bytes", type=int, default=None, help="default: one bandwidth-delay product")
    run.add_argument("--seed", type=int, default=None, help="seed for the loss generator")
    run.add_argument(
        "--control-file", type=Path, default=None, help="re-read on SIGHUP to change the link; state in PATH.state"
    )
    for name in ("netns-add", "netns-del"):
        commands.add_parser(name, help=f"{name.split('-')[1]} a test namespace").add_argument("name")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "netns-add":
        create_namespace(args.name)
    elif args.command == "netns-del":
        delete_namespace(args.name)
    else:
        try:
            spec = LinkSpec(args.rate_mbit, args.rtt_ms, args.loss_pct, args.queue_bytes)
            a = Endpoint(args.ns_a, args.dev_a, args.addr_a, tuple(args.route_a))
            b = Endpoint(args.ns_b, args.dev_b, args.addr_b, tuple(args.route_b))
            serve_link(
                a, b, spec, ready=lambda: print("ready", flush=True), seed=args.seed, control_file=args.control_file
            )
        except (ValueError, RuntimeError, OSError) as error:
            print(f"wanlink: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
