"""The coordinator's hivemind DHT node: the swarm's meeting point, so a join string is all a peer needs.

Its libp2p identity is kept in the state directory, so its address stays the same across restarts
when the port does.
"""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Optional

import hivemind

logger = logging.getLogger(__name__)

IDENTITY_FILE = "dht-identity.key"


def _maddr(host: str, port: int) -> str:
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{version}/{host}/tcp/{port}"


class DHTNode:
    """Start with ``start()``; ``initial_peers`` are the multiaddrs peers should bootstrap from."""

    def __init__(self, *, state_dir: Path, host: str, port: int = 0, announce_host: Optional[str] = None) -> None:
        self._state_dir = Path(state_dir)
        # A wildcard address is not one a peer can dial; without an announced address, stay on loopback.
        wildcard = host in ("0.0.0.0", "::", "")
        self._host = "127.0.0.1" if wildcard and announce_host is None else host
        self._port = port
        self._announce_host = announce_host
        self._dht: Optional[hivemind.DHT] = None
        self.initial_peers: list[str] = []

    def start(self) -> list[str]:
        announce = [_maddr(self._announce_host, self._port)] if self._announce_host and self._port else None
        self._dht = hivemind.DHT(
            start=True,
            host_maddrs=[_maddr(self._host, self._port)],
            announce_maddrs=announce,
            identity_path=str(self._state_dir / IDENTITY_FILE),
        )
        visible = [str(m) for m in self._dht.get_visible_maddrs()]
        if self._announce_host:
            # With port 0 the port is known only now: tell peers the announced host with the bound port.
            peer_id = self._dht.peer_id.to_base58()
            ports = {m.split("/tcp/")[1].split("/")[0] for m in visible if "/tcp/" in m}
            visible = [f"{_maddr(self._announce_host, int(p))}/p2p/{peer_id}" for p in sorted(ports)]
        self.initial_peers = visible
        logger.info("DHT node listening at %s", ", ".join(visible))
        return visible

    def stop(self) -> None:
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
