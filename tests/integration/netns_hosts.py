"""Minimal emulated hosts for integration tests: Linux network namespaces on one bridge.

Each host is a namespace with one veth to a bridge that lives in a namespace of its own, so nothing is
added to this machine's own network; deleting the namespaces removes every link with them. All names
start with a per-instance prefix (``swa-`` + random hex), and ``close()`` deletes only those.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

PREFIX = "swa-"


def missing_privilege() -> str:
    """Why network namespaces cannot be made here, or "" when they can."""
    if not shutil.which("ip"):
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class NetnsHosts:
    """``count`` hosts at 10.<subnet>.<subnet2>.(i+1)/24 on one bridge; ``namespaces[i]`` is host i."""

    count: int
    tag: str = field(default_factory=lambda: PREFIX + secrets.token_hex(2))
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        octets = secrets.randbelow(200) + 20, secrets.randbelow(250) + 1
        self.subnet = f"10.{octets[0]}.{octets[1]}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    def create(self) -> "NetnsHosts":
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(self.count):
                ns, address = f"{self.tag}-h{i}", f"{self.subnet}.{i + 1}"
                self._add_ns(ns)
                # both ends are created inside the host's namespace, then one moves to the bridge's
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"{self.tag}-p{i}")
                _ip("-n", ns, "link", "set", f"{self.tag}-p{i}", "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", f"{self.tag}-p{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.namespaces.append(ns)
                self.addresses.append(address)
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        assert name.startswith(PREFIX)
        _ip("netns", "add", name)
        self._made.append(name)

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def close(self) -> None:
        """Delete the namespaces this instance made (their links go with them); safe to call twice."""
        while self._made:
            name = self._made.pop()
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)

    def __enter__(self) -> "NetnsHosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()
