"""Network namespaces and TUN devices: create, join to a namespace, address and route."""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass
from ipaddress import IPv4Interface, IPv4Network

from pdstack.local.commands import run_captured
from pdstack.local.wan.shape import TUN_MTU

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
DEFAULT_SUBNET = "10.203.0.0/24"


@dataclass(frozen=True)
class TunEndpoint:
    """One side of the link: the namespace, the TUN device's name there and its address (with prefix)."""

    namespace: str
    device: str
    address: IPv4Interface
    routes: tuple[IPv4Network, ...] = ()


def run_ip(*args: str) -> None:
    run_captured(["ip", *args])


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


def attach(fd_name: str, endpoint: TunEndpoint) -> None:
    """Move a TUN device into its endpoint's namespace and give it its address and routes."""
    if not namespace_exists(endpoint.namespace):
        raise ValueError(f"namespace {endpoint.namespace!r} does not exist (create it with `ip netns add`)")
    run_ip("link", "set", fd_name, "netns", endpoint.namespace, "name", endpoint.device)
    run_ip("-n", endpoint.namespace, "link", "set", endpoint.device, "mtu", str(TUN_MTU), "up")
    run_ip("-n", endpoint.namespace, "addr", "add", str(endpoint.address), "dev", endpoint.device)
    for route in endpoint.routes:
        run_ip("-n", endpoint.namespace, "route", "replace", str(route), "dev", endpoint.device)


def default_endpoints(ns_a: str, ns_b: str, subnet: str = DEFAULT_SUBNET) -> tuple[TunEndpoint, TunEndpoint]:
    network = IPv4Network(subnet)
    hosts = network.hosts()
    first, second = next(hosts), next(hosts)
    return (
        TunEndpoint(ns_a, "wan0", IPv4Interface(f"{first}/{network.prefixlen}")),
        TunEndpoint(ns_b, "wan0", IPv4Interface(f"{second}/{network.prefixlen}")),
    )
