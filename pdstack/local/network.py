"""Build and remove the local environment's networks: a router namespace per datacenter, a namespace per node,
and an emulated WAN link (pdstack.local.wan) for every link the local stacks declare.

    host ── uplink veth ── router ns "dc1" ── bridge ── veth ── node ns "dc1-prefill-1"  (node container joins it)
                              │ TUN
                       WAN forwarder (rate, delay, loss from the stack's link)
                              │ TUN
                           router ns "dc2" ── bridge ── veth ── node ns "dc2-decode-1"

The host keeps one service address (SERVICE_ADDRESS) that every node reaches through its router: the image
registry listens there. Nodes reach package mirrors through the host's NAT. Every step checks before it acts, so
`up` twice changes nothing, and `down` removes exactly what `up` made.

A running WAN link can be reshaped (`shape_link`, `pdstack local link`): its forwarder re-reads a control file on
SIGHUP and confirms the spec in force, so live connections see a loss spike or a delay change as they would under
`tc qdisc change ... netem`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pdstack.local.commands import run_captured
from pdstack.local.procs import command_line
from pdstack.local.topology import LOCAL_SUPERNET, SERVICE_ADDRESS, LocalDatacenter, LocalLink, Node, Topology
from pdstack.local.wan import CONTROL_FIELDS, LinkShape, TunEndpoint, change_link, link_command, read_state, state_path
from pdstack.local.wan.process import MODULE as WAN_MODULE

MTU = "65000"  # as the WAN's TUN devices: large segments keep the user-space forwarder's packet rate low
NAT_COMMENT = "pdstack-local"


class NetworkError(RuntimeError):
    """A WAN link is unknown, not running or did not come up (a failed `ip`/`iptables` raises CommandError)."""


class UnknownLinkError(NetworkError):
    pass


def declared_spec(link: LocalLink) -> LinkShape:
    """The link as the stacks declare it."""
    return LinkShape(rate_mbit=link.rate_mbit, rtt_ms=link.rtt_ms, loss_pct=link.loss_pct)


def link_name(link: LocalLink) -> str:
    return f"{link.a}<->{link.b}"


@dataclass(frozen=True)
class LinkStatus:
    """A running WAN link: what the stacks declare, its forwarder, and the spec in force."""

    link: LocalLink
    pid: int
    spec: LinkShape

    @property
    def declared(self) -> LinkShape:
        return declared_spec(self.link)

    def as_dict(self) -> dict[str, object]:
        def fields(spec: LinkShape) -> dict[str, float]:
            return {name: getattr(spec, name) for name in CONTROL_FIELDS}

        return {
            "link": link_name(self.link),
            "pid": self.pid,
            "spec": fields(self.spec),
            "declared": fields(self.declared),
        }


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """run_captured with the arguments spelled out, as the many `ip` calls below read best."""
    return run_captured(args, check=check)


def add_veth(device: str, peer: str, peer_namespace: str, *, namespace: str | None = None) -> None:
    """A veth pair of MTU-sized ends: `device` in `namespace` (the host's by default), `peer` in `peer_namespace`."""
    where = ["-n", namespace] if namespace else []
    sh(
        "ip",
        *where,
        "link",
        "add",
        device,
        "mtu",
        MTU,
        "type",
        "veth",
        "peer",
        "name",
        peer,
        "netns",
        peer_namespace,
        "mtu",
        MTU,
    )


def namespaces() -> set[str]:
    return {line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()}


def link_exists(device: str, namespace: str | None = None) -> bool:
    prefix = ["ip", "-n", namespace] if namespace else ["ip"]
    return sh(*prefix, "link", "show", device, check=False).returncode == 0


def has_service_address() -> bool:
    return f" {SERVICE_ADDRESS}/32 " in sh("ip", "-o", "addr", "show", "dev", "lo").stdout


def in_ns(namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", namespace, *args, check=check)


class LocalNetwork:
    def __init__(self, topology: Topology, state_dir: Path) -> None:
        self.topology = topology
        self.state_dir = state_dir

    # -- up -------------------------------------------------------------------------------------------------------

    def up(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._service_address()
        for dc in self.topology.datacenters:
            self._router(dc)
            for node in dc.nodes:
                self._node(dc, node)
        self._nat()
        for link in self.topology.links:
            self._start_link(link)

    def _service_address(self) -> None:
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
        if not has_service_address():
            sh("ip", "addr", "add", f"{SERVICE_ADDRESS}/32", "dev", "lo")

    def _router(self, dc: LocalDatacenter) -> None:
        ns = dc.router_namespace
        if ns in namespaces():
            return
        sh("ip", "netns", "add", ns)
        for setting in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
            in_ns(ns, "sysctl", "-qw", setting)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "add", "br0", "mtu", MTU, "type", "bridge")
        sh("ip", "-n", ns, "addr", "add", str(dc.gateway), "dev", "br0")
        sh("ip", "-n", ns, "link", "set", "br0", "up")
        add_veth(dc.uplink_device, "uplink", ns)
        sh("ip", "addr", "add", str(dc.uplink_host), "dev", dc.uplink_device)
        sh("ip", "link", "set", dc.uplink_device, "up")
        sh("ip", "-n", ns, "addr", "add", str(dc.uplink_router), "dev", "uplink")
        sh("ip", "-n", ns, "link", "set", "uplink", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", str(dc.uplink_host.ip))
        sh("ip", "route", "replace", str(dc.network), "via", str(dc.uplink_router.ip))

    def _node(self, dc: LocalDatacenter, node: Node) -> None:
        ns = node.namespace
        if ns in namespaces():
            return
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        port = f"v{node.address.ip.packed[-1]}"
        add_veth(port, "eth0", ns, namespace=dc.router_namespace)
        sh("ip", "-n", dc.router_namespace, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", str(node.address), "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", str(dc.gateway.ip))

    def remove_node(self, node: Node) -> None:
        """A node's namespace gone (its veth pair with it): a node the group no longer has."""
        if node.namespace in namespaces():
            sh("ip", "netns", "delete", node.namespace)

    def _nat_rules(self) -> list[list[str]]:
        net = str(LOCAL_SUPERNET)
        tag = ["-m", "comment", "--comment", NAT_COMMENT]
        return [
            ["-t", "nat", "POSTROUTING", "-s", net, "!", "-d", net, *tag, "-j", "MASQUERADE"],
            ["-t", "filter", "FORWARD", "-s", net, *tag, "-j", "ACCEPT"],
            ["-t", "filter", "FORWARD", "-d", net, *tag, "-j", "ACCEPT"],
        ]

    def _nat(self) -> None:
        for rule in self._nat_rules():
            table, chain, *spec = rule[1], rule[2], *rule[3:]
            if sh("iptables", "-t", table, "-C", chain, *spec, check=False).returncode != 0:
                sh("iptables", "-t", table, "-A", chain, *spec)

    def _pid_file(self, link: LocalLink) -> Path:
        return self.state_dir / f"link-{link.a}-{link.b}.pid"

    def _control_file(self, link: LocalLink) -> Path:
        return self.state_dir / f"link-{link.a}-{link.b}.json"

    def link_pid(self, link: LocalLink) -> int | None:
        """The pid of the link's running forwarder (None when the pid file names no running WAN forwarder)."""
        path = self._pid_file(link)
        if not path.is_file():
            return None
        pid = int(path.read_text())
        return pid if WAN_MODULE in command_line(pid) else None

    def _start_link(self, link: LocalLink) -> None:
        if self.link_pid(link) is not None:
            return
        a, b = self.topology.datacenter(link.a), self.topology.datacenter(link.b)
        addr_a, addr_b = link.addresses()
        end_a = TunEndpoint(a.router_namespace, link.device_towards(b.name), addr_a, (b.network,))
        end_b = TunEndpoint(b.router_namespace, link.device_towards(a.name), addr_b, (a.network,))
        control = self._control_file(link)
        control.unlink(missing_ok=True)
        state_path(control).unlink(missing_ok=True)  # a dead forwarder's state must not pass for the new one's
        log = self.state_dir / f"link-{link.a}-{link.b}.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                link_command(end_a, end_b, declared_spec(link), control_file=control),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._pid_file(link).write_text(str(process.pid))
        deadline = time.monotonic() + 15
        while "ready" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise NetworkError(f"WAN link {link.a}<->{link.b} did not come up: {log.read_text()[-1000:]}")
            time.sleep(0.1)

    # -- down -----------------------------------------------------------------------------------------------------

    def down(self) -> None:
        for link in self.topology.links:
            pid = self.link_pid(link)
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
                _wait_gone(pid)
            self._pid_file(link).unlink(missing_ok=True)
            self._control_file(link).unlink(missing_ok=True)
            state_path(self._control_file(link)).unlink(missing_ok=True)
        present = namespaces()
        for dc in self.topology.datacenters:
            for node in dc.nodes:
                if node.namespace in present:
                    sh("ip", "netns", "delete", node.namespace)
            if dc.router_namespace in present:
                sh("ip", "netns", "delete", dc.router_namespace)  # takes the uplink veth and its host route along
            if link_exists(dc.uplink_device):
                sh("ip", "link", "delete", dc.uplink_device)
        for rule in self._nat_rules():
            table, chain, *spec = rule[1], rule[2], *rule[3:]
            while sh("iptables", "-t", table, "-C", chain, *spec, check=False).returncode == 0:
                sh("iptables", "-t", table, "-D", chain, *spec)
        if has_service_address():
            sh("ip", "addr", "del", f"{SERVICE_ADDRESS}/32", "dev", "lo")

    # -- changing a running link ------------------------------------------------------------------------------------

    def find_link(self, a: str, b: str) -> LocalLink:
        """The link between datacenters `a` and `b` (either order); UnknownLinkError names it when there is none."""
        for link in self.topology.links:
            if {link.a, link.b} == {a, b}:
                return link
        known = ", ".join(link_name(link) for link in self.topology.links) or "none"
        raise UnknownLinkError(f"no WAN link {a}<->{b} in the local stacks (links: {known})")

    def link_status(self, a: str, b: str) -> LinkStatus:
        """The running link's spec in force, as its forwarder publishes it."""
        link = self.find_link(a, b)
        pid = self._controllable_pid(link)
        try:
            return LinkStatus(link, pid, read_state(pid, self._control_file(link)).spec)
        except RuntimeError as error:
            raise NetworkError(f"WAN link {link_name(link)}: {error}") from error

    def shape_link(
        self,
        a: str,
        b: str,
        *,
        rate_mbit: float | None = None,
        rtt_ms: float | None = None,
        loss_pct: float | None = None,
        reset: bool = False,
        timeout_s: float = 10.0,
    ) -> LinkStatus:
        """Change the running link between `a` and `b`: each value given replaces the one in force (None keeps it);
        `reset` first goes back to what the stacks declare. Returns once the forwarder confirms the new spec, without
        restarting it: its TUN devices, the packets in flight and the connections across the link live on.

        A value out of range raises ValueError naming it, and the link stays as it was."""
        link = self.find_link(a, b)
        pid = self._controllable_pid(link)
        changes = {name: getattr(declared_spec(link), name) for name in CONTROL_FIELDS} if reset else {}
        given = {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms, "loss_pct": loss_pct}
        changes.update({name: value for name, value in given.items() if value is not None})
        if not changes:
            return self.link_status(a, b)
        try:
            spec = change_link(pid, self._control_file(link), changes, timeout_s)
        except ValueError as error:
            raise ValueError(f"WAN link {link_name(link)}: {error}") from error
        except (RuntimeError, TimeoutError) as error:
            raise NetworkError(f"WAN link {link_name(link)}: {error}") from error
        return LinkStatus(link, pid, spec)

    def _controllable_pid(self, link: LocalLink) -> int:
        pid = self.link_pid(link)
        if pid is None:
            raise NetworkError(f"WAN link {link_name(link)} is not running (`pdstack local up` starts it)")
        # SIGHUP would end a forwarder that does not handle it: never send one to a forwarder without a control file.
        if "--control-file" not in command_line(pid):
            raise NetworkError(
                f"WAN link {link_name(link)}: its forwarder (pid {pid}) was started without --control-file by an "
                "older pdstack and cannot be changed while it runs; `pdstack local down` and `up` restart it"
            )
        return pid

    # -- inspection -----------------------------------------------------------------------------------------------

    def leftovers(self) -> list[str]:
        """What of this network still exists on the machine (empty after `down`)."""
        found = [f"namespace {ns}" for ns in sorted(namespaces()) if ns.startswith("pds")]
        found += [f"address {SERVICE_ADDRESS}"] if has_service_address() else []
        found += [f"device {dc.uplink_device}" for dc in self.topology.datacenters if link_exists(dc.uplink_device)]
        found += [f"WAN link {link.a}<->{link.b}" for link in self.topology.links if self.link_pid(link) is not None]
        rules = sh("iptables-save", check=False).stdout
        found += ["iptables rules"] if NAT_COMMENT in rules else []
        return found


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our own child (a test that ran `up` itself)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
