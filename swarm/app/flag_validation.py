"""The flags of the `swarm` command, checked before anything starts: each bad one gets one sentence (and exit 2,
from ``swarm.app.cli``)."""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Optional

from swarm.net.bulk.tcp_congestion import congestion_problem

# (flag, low, high) per command: the range of each number a user may give.
_NUMBER_FLAGS: dict[str, tuple[tuple[str, float, float], ...]] = {
    "coordinator": (
        ("port", 0, 65535),
        ("dht_port", 0, 65535),
        ("max_rounds", 1, 10**9),
        ("min_peers", 1, 10**5),
        ("inner_steps", 1, 10**7),
        ("lease_s", 0.1, 86400),
        ("exit_grace_s", 0, 86400),
    ),
    "peer": (
        ("p2p_port", 0, 65535),
        ("threads", 1, 4096),
        ("nproc", 1, 1024),
        ("join_timeout_s", 0.1, 7 * 86400),
        ("checkpoint_every", 0, 10**9),
        ("final_serve_s", 0, 86400),
        ("uplink_mbit", 0, 10**6),
        ("max_restarts", 0, 10**6),
    ),
    "status": (("interval", 0.1, 3600), ("count", 1, 10**9)),
    "demo": (("peers", 1, 64), ("rounds", 1, 10**6), ("inner_steps", 1, 10**7), ("timeout", 1, 7 * 86400)),
    "token": (("max_uses", 1, 10**9),),
}
# what torch.device takes for a device to train on: a kind, and for the kinds with several devices an index
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:[0-9]{1,4})?")
DEVICE_FORMS = "cpu, cuda (the first GPU), cuda:N (GPU N), mps (Apple silicon) or xpu[:N] (Intel GPUs)"

_TEXT_FLAGS = ("host", "announce_host", "p2p_host", "site", "name", "preset", "device", "tcp_congestion")


def validate_args(args: argparse.Namespace) -> Optional[str]:
    """One sentence about the first bad flag in ``args``, or None when they are all fine."""
    for name, low, high in _NUMBER_FLAGS.get(args.command, ()):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            return f"--{name.replace('_', '-')} must be from {low:g} to {high:g}, got {value:g}."
    for name in _TEXT_FLAGS:
        value = getattr(args, name, None)
        if value is not None and (len(value.encode("utf-8", "surrogateescape")) > 256 or not value.isprintable()):
            return f"--{name.replace('_', '-')} must be at most 256 bytes of printable text."
    device = getattr(args, "device", None)
    if device is not None and not _DEVICE.fullmatch(device):
        return f"--device {device!r} is not a device torch can train on; give {DEVICE_FORMS}."
    for name in ("state_dir",):
        value = getattr(args, name, None)
        if value and os.path.exists(value) and not os.path.isdir(value):
            return f"--state-dir {value!r} is a file; give a directory (it is created when missing)."
    if getattr(args, "tcp_congestion", None) is not None:
        return congestion_problem(args.tcp_congestion)
    return None
