"""The coordinator's hivemind DHT node: the swarm's meeting point, so a join string is all a peer needs.

Its libp2p identity is kept in the state directory, so its address stays the same across restarts
when the port does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from pathlib import Path
from typing import Optional, Sequence

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

import swarm.net  # noqa: F401  first: it keeps hivemind's import from loading scipy.optimize (swarm.net.deferred_imports)
from coordinator.api.limits import parse_dht_maddr
from swarm.net.bulk.transport import exit_with_parent
from swarm.net.link.p2p_address import maddr
from swarm.net.link.relay import Allowed, RelayNode

logger = logging.getLogger(__name__)

IDENTITY_FILE = "dht-identity.key"
DIAL_TIMEOUT_S = 5.0  # connect and ping one peer; peers are dialled at once, so also about the total
MAX_DIALLED_PEERS = 64  # the rest find the node themselves: they know its address


def _port_free(host: str, port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as p2pd binds: TIME_WAIT is free
            probe.bind((host, port))
        return True
    except OSError:
        return False


def _peer_of(maddr: str) -> str:
    return Multiaddr(maddr)["p2p"]


async def _dial(maddrs: list[str], timeout_s: float, _dht, node) -> int:
    """Runs inside the DHT process: connect to each peer and ping it, which puts each in the other's
    routing table. Returns how many answered."""
    by_peer: dict[str, list[Multiaddr]] = {}
    for m in maddrs:
        pid = _peer_of(m)
        by_peer.setdefault(pid, []).append(Multiaddr(m).decapsulate(Multiaddr(f"/p2p/{pid}")))

    async def connect_and_ping(peer: PeerID, addrs: list[Multiaddr]) -> bool:
        await node.p2p._client.connect(peer, addrs)
        return await node.protocol.call_ping(peer) is not None

    async def one(pid: str, addrs: list[Multiaddr]) -> bool:
        try:
            return await asyncio.wait_for(connect_and_ping(PeerID.from_base58(pid), addrs), timeout_s)
        except Exception:  # gone since its last heartbeat: nothing to reconnect
            return False

    return sum(await asyncio.gather(*(one(pid, addrs) for pid, addrs in by_peer.items())))


class DHTNode:
    """Start with ``start()``; ``initial_peers`` are the multiaddrs peers should bootstrap from."""

    def __init__(
        self,
        *,
        state_dir: Path,
        host: str,
        port: int = 0,
        announce_host: Optional[str] = None,
        previous_port: int = 0,
        record_validators: Sequence[RecordValidatorBase] = (),
    ) -> None:
        self._state_dir = Path(state_dir)
        self._record_validators = list(record_validators)  # e.g. members' signed entries only
        # A wildcard address is not one a peer can dial; without an announced address, stay on loopback.
        wildcard = host in ("0.0.0.0", "::", "")
        self._host = "127.0.0.1" if wildcard and announce_host is None else host
        self._port = port
        self._previous_port = previous_port  # with port 0: the one the previous start bound, tried first
        self._announce_host = announce_host
        self._dht: Optional[hivemind.DHT] = None
        self.relay: Optional[RelayNode] = None
        self.initial_peers: list[str] = []
        self.port = 0  # bound, known after start()

    def start(self, bootstrap: Sequence[str] = ()) -> list[str]:
        """Listen (on the previous start's port when it is free) and, when ``bootstrap`` names peers'
        DHT addresses (a restart), dial them so that the peers that kept training through the outage and
        those that join through this node meet; a peer that is gone is skipped.

        Dialing happens after the start, not as hivemind's initial_peers: with those, one unreachable
        address fails the whole start, and in this process a failed DHT start can break the next one's
        shared memory (RuntimeError: Broken pipe)."""
        port = self._port
        if port == 0 and self._previous_port and _port_free(self._host, self._previous_port):
            port = self._previous_port
        announce = [maddr(self._announce_host, port)] if self._announce_host and port else None
        self._dht = hivemind.DHT(
            start=True,
            host_maddrs=[maddr(self._host, port)],
            announce_maddrs=announce,
            identity_path=str(self._state_dir / IDENTITY_FILE),
            record_validators=self._record_validators,
        )
        self._orphan_watch = exit_with_parent(self._dht)
        visible = [str(m) for m in self._dht.get_visible_maddrs()]
        ports = {m.split("/tcp/")[1].split("/")[0] for m in visible if "/tcp/" in m}
        self.port = int(min(ports)) if ports else 0
        if self._announce_host:
            # With port 0 the port is known only now: tell peers the announced host with the bound port.
            peer_id = self._dht.peer_id.to_base58()
            visible = [f"{maddr(self._announce_host, int(p))}/p2p/{peer_id}" for p in sorted(ports)]
        self.initial_peers = visible
        logger.info("DHT node listening at %s", ", ".join(visible))
        self._redial(bootstrap)
        return visible

    def _redial(self, bootstrap: Sequence[str]) -> None:
        """Dial the peers' valid addresses, each within DIAL_TIMEOUT_S and all at once; a bad address is
        logged in one line and dropped, and nothing here can hold up the start for long."""
        assert self._dht is not None
        valid = [m for m in bootstrap if parse_dht_maddr(m) is not None]
        if len(valid) < len(bootstrap):
            logger.warning(
                "DHT node: dropped %d stored peer addresses that are not multiaddrs ending in /p2p/<id>",
                len(bootstrap) - len(valid),
            )
        peers = list(dict.fromkeys(_peer_of(m) for m in valid))[:MAX_DIALLED_PEERS]
        valid = [m for m in valid if _peer_of(m) in peers]
        if not valid:
            return
        future = self._dht.run_coroutine(functools.partial(_dial, valid, DIAL_TIMEOUT_S), return_future=True)
        try:
            reached = future.result(timeout=DIAL_TIMEOUT_S + 5.0)
        except Exception as e:  # a timeout or a failure inside the DHT process: the peers will call in
            future.cancel()
            logger.warning(
                "DHT node: reconnecting to the peers it knew failed (%s); they reconnect themselves", type(e).__name__
            )
            return
        logger.info("DHT node reconnected to %d of the %d peers it knew", reached, len(peers))

    def start_relay(self, allowed: Allowed) -> None:
        """Forward streams between members that cannot dial each other (``swarm.net.link.relay``); ``allowed``
        says whether a libp2p id is one of the run's live members."""
        assert self._dht is not None
        self.relay = RelayNode(self._dht, allowed)

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.stop()
            self.relay = None
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
