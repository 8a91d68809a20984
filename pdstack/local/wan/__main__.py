"""The WAN link's CLI:

python -m pdstack.local.wan run --ns-a A --ns-b B --rate-mbit 1000 --rtt-ms 20 --loss-pct 0 [--control-file PATH]
python -m pdstack.local.wan netns-add NAME | netns-del NAME
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from ipaddress import IPv4Interface, IPv4Network
from pathlib import Path

from pdstack.local.wan.process import MODULE
from pdstack.local.wan.serve import serve_link
from pdstack.local.wan.shape import LinkShape
from pdstack.local.wan.tun import TunEndpoint, create_namespace, delete_namespace


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="An emulated WAN link, in user space.")
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
            spec = LinkShape(args.rate_mbit, args.rtt_ms, args.loss_pct, args.queue_bytes)
            a = TunEndpoint(args.ns_a, args.dev_a, args.addr_a, tuple(args.route_a))
            b = TunEndpoint(args.ns_b, args.dev_b, args.addr_b, tuple(args.route_b))
            serve_link(
                a, b, spec, ready=lambda: print("ready", flush=True), seed=args.seed, control_file=args.control_file
            )
        except (ValueError, RuntimeError, OSError) as error:
            print(f"wanlink: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
