"""One link as a child process (`python -m pdstack.local.wan run ...`), and the command line that starts it."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from pdstack.local.wan.control import LinkState, change_link, read_state
from pdstack.local.wan.shape import LinkShape
from pdstack.local.wan.tun import TunEndpoint

MODULE = "pdstack.local.wan"  # what a forwarder's command line names (how a pid file's process is recognised)


class LinkProcess:
    """The link running as a child process; a context manager."""

    def __init__(
        self, a: TunEndpoint, b: TunEndpoint, spec: LinkShape, seed: int | None = None, control_file: Path | None = None
    ) -> None:
        self.a, self.b, self.spec, self.control_file = a, b, spec, control_file
        self._argv = link_command(a, b, spec, seed, control_file)
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

    def change(self, timeout_s: float = 10.0, **changes: float) -> LinkShape:
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


def link_command(
    a: TunEndpoint, b: TunEndpoint, spec: LinkShape, seed: int | None = None, control_file: Path | None = None
) -> list[str]:
    """The command line of a forwarder joining `a` and `b` by a link of shape `spec`."""
    argv = [
        sys.executable,
        "-m",
        MODULE,
        "run",
        "--ns-a",
        a.namespace,
        "--ns-b",
        b.namespace,
        "--dev-a",
        a.device,
        "--dev-b",
        b.device,
        "--addr-a",
        str(a.address),
        "--addr-b",
        str(b.address),
        "--rate-mbit",
        str(spec.rate_mbit),
        "--rtt-ms",
        str(spec.rtt_ms),
        "--loss-pct",
        str(spec.loss_pct),
    ]
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
