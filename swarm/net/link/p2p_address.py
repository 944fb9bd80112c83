"""Where a peer's libp2p node listens and which address it announces to its groupmates.

Groupmates dial each other by the addresses each node announces, so a node that announces only
127.0.0.1 (or a bridge address nobody else can route to) joins the run and then cannot be sent a slice.
By default a peer announces the local address of its route to the coordinator: the address the
coordinator's network sees it from, which its groupmates on that network can reach too. A coordinator
on loopback keeps the whole run on loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

_DISCARD_PORT = 9  # any port: a UDP connect() only picks the route, nothing is sent


@dataclass(frozen=True)
class P2PAddress:
    listen_host: str  # the interface the node listens on (0.0.0.0: all)
    announce_host: Optional[str]  # what groupmates are told to dial; None: the listen address itself


def route_source_address(host: str) -> Optional[str]:
    """The local address this machine sends from to reach ``host`` (resolved if a name), or None when
    there is no route. A UDP socket's connect() only asks the kernel for the route: no packet is sent."""
    try:
        infos = socket.getaddrinfo(host, _DISCARD_PORT, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(target)
                return probe.getsockname()[0]
        except OSError:
            continue
    return None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def choose_p2p_address(
    *, coordinator_host: str, p2p_host: Optional[str] = None, announce_host: Optional[str] = None
) -> P2PAddress:
    """The node's listen and announce addresses: ``p2p_host`` when given, else all interfaces (only the
    loopback address it announces when that is loopback); ``announce_host`` when given, else the address it listens
    on when that is one address, else the route's source address towards the coordinator. No announce
    is needed when it would repeat the listen address."""
    if announce_host or (p2p_host and not is_wildcard(p2p_host)):
        announce = announce_host or p2p_host
    else:
        announce = route_source_address(coordinator_host)
    if announce is None:
        logger.warning(
            "no route to the coordinator's host %s to learn this machine's address from; groupmates "
            "will be told every local address (pass --announce-host to choose one)",
            coordinator_host,
        )
    if p2p_host:
        listen = p2p_host
    elif announce is not None and is_loopback(announce):
        listen = announce  # e.g. 127.0.1.1, which some systems resolve their own host name to
    else:
        listen = "::" if announce is not None and ":" in announce else "0.0.0.0"
    if announce == listen:
        announce = None
    return P2PAddress(listen_host=listen, announce_host=announce)


def maddr(host: str, port: int) -> str:
    """A TCP multiaddr for an IP address or a DNS name."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{version}/{host}/tcp/{port}"


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now. hivemind refuses port 0 in announced addresses, so a node that
    announces picks its port first; another process may take it before the node binds, and the start
    then fails and is retried with a fresh one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def unreachable_sentence(own_maddrs: list[str]) -> str:
    """What a peer its groupmates cannot reach tells its user."""
    shown = ", ".join(own_maddrs) or "no announced address"
    return (
        f"groupmates cannot reach this peer at {shown}; pass --announce-host ADDRESS reachable from them "
        "(and open the port)"
    )


def only_loopback(maddrs: list[str]) -> bool:
    """True when every address in ``maddrs`` is a loopback one (or there are none)."""
    hosts = [m.split("/")[2] for m in maddrs if m.startswith(("/ip4/", "/ip6/"))]
    return all(is_loopback(h) for h in hosts) and len(hosts) == len(maddrs)
