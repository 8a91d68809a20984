"""An emulated WAN link between two network namespaces, in user space.

Kernels without `sch_netem` (like the CI machines) cannot add delay or loss with `tc`. This package emulates the link
instead: a TUN device is created for each side and moved into that side's network namespace (MTU 65000), and a
forwarder process moves each packet from one TUN to the other after its serialisation time at the link rate plus the
one-way delay (half the RTT). It drops a packet with the configured loss probability, and tail-drops when the queue
waiting for the serialiser exceeds the queue limit (by default one bandwidth-delay product), so TCP sees a real
bottleneck. Where the kernel has netem, `tc qdisc add dev DEV root netem delay .. loss .. rate ..` on a veth pair is
the simpler choice; this forwarder is the fallback design that works everywhere TUN does.

Like `tc qdisc change ... netem`, a running link can be reshaped: with `--control-file PATH`, the forwarder re-reads
PATH on SIGHUP (a JSON object with any of rate_mbit, rtt_ms, loss_pct; the rest stay as they are) and applies it to
the packets that arrive from then on, keeping its TUN devices and the packets in flight. It publishes the shape in
force in PATH.state (pid, reload count, shape, and the error when a file was rejected: a bad file never changes the
shape). `change_link` does all of that for a caller and returns once the forwarder confirms the new shape.

Modules: `shape` (the link model: rate, delay, loss, queue), `forwarder` (moves packets between two TUNs),
`control` (run-time changes), `tun` (namespaces and TUN devices), `serve` (one link, in this process),
`process` (one link as a child process), `__main__` (the CLI:
`python -m pdstack.local.wan run --ns-a A --ns-b B --rate-mbit 1000 --rtt-ms 20 [--control-file PATH]`).
"""

from pdstack.local.wan.control import CONTROL_FIELDS, LinkState, change_link, read_state, state_path
from pdstack.local.wan.process import LinkProcess, link_command
from pdstack.local.wan.shape import TUN_MTU, LinkDirection, LinkShape
from pdstack.local.wan.tun import TunEndpoint, create_namespace, default_endpoints, delete_namespace, run_ip

__all__ = [
    "CONTROL_FIELDS",
    "TUN_MTU",
    "LinkDirection",
    "LinkProcess",
    "LinkShape",
    "LinkState",
    "TunEndpoint",
    "change_link",
    "create_namespace",
    "default_endpoints",
    "delete_namespace",
    "link_command",
    "read_state",
    "run_ip",
    "state_path",
]
