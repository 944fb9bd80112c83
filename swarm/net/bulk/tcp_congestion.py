"""The congestion control of the bulk connections (``swarm.net.bulk.bulk_sender``).

Each connection uses ``CONGESTION_CONTROL`` (cubic, Linux's usual default) rather than the
system's. In the butterfly K − 1 flows converge on every member's downlink at once; where the system default
is BBR (v1), the exchange took 1.28–1.35× the ideal at 4 peers on 100 Mbit/s links against 1.12–1.24× (median
1.15×) with cubic, measured side by side (docs/BENCHMARKS.md, "Weak links"); raw TCP moved alike. An operator
picks another with ``swarm peer --tcp-congestion`` (``system``: the system's own)."""

from __future__ import annotations

import errno
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


def try_congestion(name: str) -> Optional[OSError]:
    """Set ``name`` on a throwaway socket: None when this process may use it, else why not (EPERM: the system
    has it but lets an unprivileged process pick only those in net.ipv4.tcp_allowed_congestion_control)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return _pick(sock, name)


def _pick(sock: socket.socket, name: str) -> Optional[OSError]:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as e:
        return e
    return None


def congestion_problem(name: str) -> Optional[str]:
    """One sentence when this process cannot give its bulk connections congestion control ``name``, else None."""
    if name == SYSTEM:
        return None
    if not hasattr(socket, "TCP_CONGESTION"):
        return (
            f"--tcp-congestion {name}: this system does not let a connection choose its congestion control; "
            f"leave the option out or give '{SYSTEM}'."
        )
    error = try_congestion(name)
    if error is None:
        return None
    if error.errno == errno.EPERM:
        return (
            f"--tcp-congestion {name}: this system has it but lets this process use only the controls in "
            f"net.ipv4.tcp_allowed_congestion_control; add {name} there (as root), run with CAP_NET_ADMIN, "
            f"or give '{SYSTEM}'."
        )
    offered = congestion_controls()
    listed = f" ({' '.join(offered)})" if offered else ""
    return (
        f"--tcp-congestion {name}: not one of this system's TCP congestion controls{listed}; "
        f"give one of them, or '{SYSTEM}' for the system's default."
    )


_warned: set[str] = set()  # the controls a connection could not pick, warned about once each


def set_congestion(sock: socket.socket, name: str) -> None:
    """Use congestion control ``name`` on ``sock``; where the system has no such control or does not let this
    process pick it (an unprivileged process may use only those in net.ipv4.tcp_allowed_congestion_control),
    the connection keeps the system's default, and the first such connection says so in the log."""
    if name == SYSTEM or not hasattr(socket, "TCP_CONGESTION"):
        return
    error = _pick(sock, name)
    if error is not None and name not in _warned:
        _warned.add(name)
        logger.warning(
            "bulk connections keep the system's TCP congestion control: this process may not pick "
            "%s (%s); to use it, add it to net.ipv4.tcp_allowed_congestion_control as root, or give "
            "swarm peer --tcp-congestion system to silence this",
            name,
            error.strerror or error,
        )
