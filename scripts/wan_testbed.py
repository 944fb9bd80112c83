#!/usr/bin/env python3
"""The WAN testbed from the command line (as root): emulated hosts in network namespaces on shaped links.

scripts/wan_testbed.py up --hosts 3 --mbit 100 --nat-host     # hosts h0 h1 h2 (10.77.0.10-12) and nat
scripts/wan_testbed.py up --hosts 5 --mbit 1000 --sites ,a,a,b,b --cross-site-mbit 20   # two sites, h0 in none
scripts/wan_testbed.py rate h1 --mbit 10                      # h1's link 10x slower while it runs
scripts/wan_testbed.py status
scripts/wan_testbed.py run h0 -- .venv/bin/swarm coordinator --host 10.77.0.10 --announce-host 10.77.0.10
scripts/wan_testbed.py proxy h1 --to h0:7000 --delay-ms 25     # h1 reaches h0:7000 25 ms away, via the port it prints
scripts/wan_testbed.py down                                   # idempotent; also after a crash
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed import make_topology, missing_privileges, teardown  # noqa: E402
from testbed.network import TestbedError, build, namespaces, shape_host  # noqa: E402
from testbed.topology import PREFIX  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _namespace(prefix: str, host: str) -> str:
    name = prefix + host
    if name not in namespaces(prefix):
        raise TestbedError(f"there is no testbed host {host!r} up; 'status' lists the hosts, 'up' creates them")
    return name


def _address(prefix: str, host: str) -> str:
    out = subprocess.run(
        ["ip", "-n", _namespace(prefix, host), "-4", "-o", "addr", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return out[out.index("inet") + 1].split("/")[0] if "inet" in out else "-"


def up(args: argparse.Namespace) -> int:
    build(_topology(args))
    return status(args)


def _topology(args: argparse.Namespace):
    sites = args.sites.split(",") if args.sites is not None else None
    return make_topology(
        hosts=args.hosts,
        mbit=args.mbit,
        up_mbit=args.up_mbit,
        down_mbit=args.down_mbit,
        nat_host=args.nat_host,
        nat_hosts=getattr(args, "nat_hosts", 0),
        prefix=args.prefix,
        sites=sites,
        cross_site_mbit=args.cross_site_mbit,
    )


def rate(args: argparse.Namespace) -> int:
    """The testbed keeps no record of how it was built, so a site-aware link is re-shaped from the sites given
    again here; without them the host's link gets one rate for all its traffic."""
    _namespace(args.prefix, args.host)
    topology = _topology(args)
    up = args.up_mbit if args.up_mbit is not None else args.mbit
    down = args.down_mbit if args.down_mbit is not None else args.mbit
    shape_host(topology, topology.host(args.host), up, down)
    return status(args)


def down(args: argparse.Namespace) -> int:
    removed = teardown(args.prefix)
    print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
    return 0


def status(args: argparse.Namespace) -> int:
    names = namespaces(args.prefix)
    if not names:
        print(f"no testbed is up (no namespace starts with {args.prefix!r})")
        return 0
    for name in sorted(names):
        host = name[len(args.prefix) :]
        rate = _upload_rate(name)
        address = (
            _address(args.prefix, host)
            if "eth0" in subprocess.run(["ip", "-n", name, "-o", "link"], capture_output=True, text=True).stdout
            else "-"
        )
        print(f"{host:6} {name:12} {address:15} upload {rate}")
    return 0


def _rates(namespace: str, what: str) -> list[str]:
    out = subprocess.run(["tc", "-n", namespace, what, "show", "dev", "eth0"], capture_output=True, text=True).stdout
    return [
        words[i + 1]
        for words in (line.split() for line in out.splitlines())
        for i, w in enumerate(words[:-1])
        if w == "rate"
    ]


def _upload_rate(namespace: str) -> str:
    """The host's upload rate as tc shows it; a site-aware link has two classes (in-site, then cross-site)."""
    classes = _rates(namespace, "class")
    if len(classes) == 2:
        return f"{classes[0]}, {classes[1]} to other sites"
    return next(iter(_rates(namespace, "qdisc")), "unshaped")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise TestbedError("give the command to run after '--', e.g. run h0 -- hostname -I")
    os.execvp("ip", ["ip", "netns", "exec", _namespace(args.prefix, args.host), *command])


def proxy(args: argparse.Namespace) -> int:
    target_host, _, port = args.to.rpartition(":")
    if not target_host or not port.isdigit():
        raise TestbedError(f"--to takes HOST:PORT (a testbed host name or an address), got {args.to!r}")
    if target_host in {n[len(args.prefix) :] for n in namespaces(args.prefix)}:
        target_host = _address(args.prefix, target_host)
    listen = f"{_address(args.prefix, args.host)}:{args.port}"
    os.chdir(ROOT)
    os.execvp(
        "ip",
        [
            "ip",
            "netns",
            "exec",
            _namespace(args.prefix, args.host),
            sys.executable,
            "-m",
            "testbed.delay_proxy",
            "--listen",
            listen,
            "--to",
            f"{target_host}:{port}",
            "--delay-ms",
            str(args.delay_ms),
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", default=PREFIX, help="every namespace the testbed creates starts with this")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("up", help="create the hosts and their links")
    p.add_argument("--hosts", type=int, default=3, help="hosts on the bridge: h0, h1, ...")
    p.add_argument("--mbit", type=float, help="upload and download rate of every host (default: unshaped)")
    p.add_argument("--up-mbit", type=float, help="upload rate, overriding --mbit")
    p.add_argument("--down-mbit", type=float, help="download rate, overriding --mbit")
    p.add_argument(
        "--nat-host", action="store_true", help="also a host 'nat' behind a router that admits no inbound connection"
    )
    p.add_argument(
        "--nat-hosts", type=int, default=0, help="that many NAT hosts (nat, nat1, ...), each behind a router of its own"
    )
    p.add_argument("--sites", help="one site label per host, comma-separated (empty: none), e.g. ,a,a,b,b")
    p.add_argument("--cross-site-mbit", type=float, help="rate each way between hosts of different sites")
    p.set_defaults(handler=up)
    p = sub.add_parser("rate", help="change a host's link rate while the testbed runs")
    p.add_argument("host")
    for flag, what in (
        ("--mbit", "upload and download rate (omitted: unshaped)"),
        ("--up-mbit", "upload rate"),
        ("--down-mbit", "download rate"),
        ("--cross-site-mbit", "as given to 'up'"),
    ):
        p.add_argument(flag, type=float, help=what)
    p.add_argument("--hosts", type=int, default=3, help="as given to 'up' (needed with --sites)")
    p.add_argument("--sites", help="as given to 'up': keeps the host's cross-site class")
    p.add_argument("--nat-host", action="store_true", help="as given to 'up'")
    p.add_argument("--nat-hosts", type=int, default=0, help="as given to 'up'")
    p.set_defaults(handler=rate)
    sub.add_parser("down", help="remove everything the testbed created").set_defaults(handler=down)
    sub.add_parser("status", help="the hosts, their addresses and rates").set_defaults(handler=status)
    p = sub.add_parser("run", help="run a command inside a host: run HOST -- COMMAND ...")
    p.add_argument("host")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(handler=run)
    p = sub.add_parser("proxy", help="forward a port of a host to another host with a one-way delay")
    p.add_argument("host", help="the host the proxy listens in (its clients' host)")
    p.add_argument("--to", required=True, help="HOST:PORT to forward to (a testbed host name or an address)")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0: any; the proxy prints it)")
    p.set_defaults(handler=proxy)
    args = parser.parse_args(argv)
    reason = missing_privileges(nat=args.action == "up" and (args.nat_host or args.nat_hosts > 0))
    if reason:
        print(f"wan_testbed: {reason}", file=sys.stderr)
        return 2
    try:
        return args.handler(args)
    except (TestbedError, ValueError) as e:
        print(f"wan_testbed: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
