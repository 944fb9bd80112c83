"""Round-trip times to other peers: a tiny request and its reply over libp2p (hivemind exposes no libp2p
ping), answered by every peer of the run."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Sequence

from swarm.net.exchange.rendezvous import Member
from swarm.net.hivemind_api import P2P, P2PContext, PeerID
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 1.0  # a peer slower to answer gets no RTT sample this time
MAX_PROBED = 16  # connected peers pinged at the join


class LinkProbe:
    """Answers pings for a run and pings others; its methods run on the transport's event loop."""

    def __init__(self, p2p: P2P, *, run_id: str) -> None:
        self.p2p = p2p
        self._name = f"swarm_{run_id}.ping"
        self._pings: Optional[asyncio.Future] = None  # sent as one exchange ends, read as the next ends

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(self._name, self._on_ping, exchange_pb2.ChunkAck)

    async def rtt_s(self, peers: Sequence[Member]) -> dict[str, float]:
        """Seconds each of ``peers`` took to answer a ping on a fresh stream (so stream setup is included), by
        peer id; none for a peer that does not answer within PING_TIMEOUT_S."""
        seconds = await asyncio.gather(*(self._ping(m.peer_id, m.dht_peer_id) for m in peers))
        return {m.peer_id: s for m, s in zip(peers, seconds) if s is not None}

    def ping_for_next(self, peers: Sequence[Member]) -> dict[str, float]:
        """The RTTs the pings sent at the previous call measured (those answered by now), by peer id; sends
        new ones to ``peers`` in the background, so no exchange ever waits for a measurement."""
        done = self._pings.result() if self._pings is not None and self._pings.done() else {}
        self._pings = asyncio.ensure_future(self.rtt_s(peers))
        return done

    async def rtt_s_to_connected(self) -> dict[str, float]:
        """By libp2p id, the RTT to the peers this node is connected to that answer (those of this run; the
        coordinator's DHT node does not): the first estimate a joining peer has, before any exchange."""
        connected = [info.peer_id.to_base58() for info in await self.p2p.list_peers()][:MAX_PROBED]
        seconds = await asyncio.gather(*(self._ping(libp2p_id, libp2p_id) for libp2p_id in connected))
        return {libp2p_id: s for libp2p_id, s in zip(connected, seconds) if s is not None}

    async def _ping(self, name: str, libp2p_id: str) -> Optional[float]:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(
                self.p2p.call_protobuf_handler(
                    PeerID.from_base58(libp2p_id), self._name, exchange_pb2.ChunkAck(ok=True), exchange_pb2.ChunkAck
                ),
                PING_TIMEOUT_S,
            )
        except Exception as e:  # a measurement, never a reason to fail what it accompanies
            logger.debug("no ping answer from %s (%r)", name, e)
            return None
        return time.perf_counter() - started

    async def _on_ping(self, request: exchange_pb2.ChunkAck, context: P2PContext) -> exchange_pb2.ChunkAck:
        return exchange_pb2.ChunkAck(ok=True)
