"""One link served in this process: both TUN devices joined to their namespaces, forwarding until SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdstack.local.wan.control import LinkControl
from pdstack.local.wan.forwarder import Forwarder
from pdstack.local.wan.shape import LinkShape
from pdstack.local.wan.tun import TunEndpoint, attach, open_tun


def serve_link(
    a: TunEndpoint,
    b: TunEndpoint,
    spec: LinkShape,
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
