"""The congestion control of the bulk connections (``swarm.net.bulk_sender``).

Each connection uses ``CONGESTION_CONTROL`` (cubic, Linux's usual default) rather than the
system's. In the butterfly K − 1 flows converge on every member's downlink at once; where the system default
is BBR (v1), the exchange took 1.28–1.35× the ideal at 4 peers on 100 Mbit/s links against 1.12–1.24× (median
1.15×) with cubic, measured side by side (docs/BENCHMARKS.md, session 17); raw TCP moved alike. An operator
picks another with ``swarm peer --tcp-congestion`` (``system``: the system's own)."""

from __future__ import annotations

import logging
import socket
from typing import Optional

logger = logging.getLogger(__name__)

CONGESTION_CONTROL = "cubic"
SYSTEM = "system"  # keep the system's default congestion control
AVAILABLE_CONGESTION = "/proc/sys/net/ipv4/tcp_available_congestion_control"


def congestion_controls() -> Optional[list[str]]:
    """The TCP congestion controls this system offers (None where it does not say: not Linux)."""
    try:
        with open(AVAILABLE_CONGESTION) as f:
            return f.read().split()
    except OSError:
        return None


def congestion_problem(name: str) -> Optional[str]:
    """One sentence when ``name`` is no congestion control this system offers, else None."""
    if name == SYSTEM:
        return None
    offered = congestion_controls()
    if offered is None or not hasattr(socket, "TCP_CONGESTION"):
        return f"--tcp-congestion {name}: this system does not let a connection choose its congestion control; " \
               f"leave the option out or give '{SYSTEM}'."
    if name not in offered:
        return f"--tcp-congestion {name}: not one of this system's TCP congestion controls ({' '.join(offered)}); " \
               f"give one of them, or '{SYSTEM}' for the system's default."
    return None


def set_congestion(sock: socket.socket, name: str) -> None:
    """Use congestion control ``name`` on ``sock``; where the system has no such control or does not let this
    process pick it (an unprivileged process may use only those in tcp_allowed_congestion_control), the
    connection keeps the system's default."""
    if name == SYSTEM or not hasattr(socket, "TCP_CONGESTION"):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as e:
        logger.debug("bulk connection keeps the system's congestion control (%s unavailable: %s)", name, e)
