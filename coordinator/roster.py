"""The coordinator's peers, indexed so that a heartbeat costs the same with ten peers or ten thousand.

Beside the records by id it keeps what every call would otherwise recount over all peers: the lease
expiries in a heap (the next to expire on top), the set of ready peers, the live and behind counters,
a version that changes whenever something a round decision or a RoundInfo depends on changed, and for
status pages the peer indexes in order, the gone peers by when they were last seen, and the sums of the
metrics that add up over peers.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable, Iterable, Optional

from coordinator import membership
from coordinator.store.records import PeerRecord

SUMMED_METRICS = (
    "bytes_sent",
    "bytes_received",
    "tokens",
    "inner_steps",
    "inner_time_s",
    "wall_time_s",
    "contributions_rejected",
    "contributions_clipped",
    "foreign_messages_dropped",
)  # over every peer


class Roster:
    """Owned by the engine, used under its lock only."""

    def __init__(self, peers: Iterable[PeerRecord], *, committed_round: int, committed_hash: str) -> None:
        self.peers: dict[str, PeerRecord] = {}
        self.alive_ids: set[str] = set()  # peers not gone
        self.live = 0  # len(alive_ids)
        self.behind = 0  # live peers whose state is older than the last committed round
        # Bumped when a peer joins, leaves or dies, becomes ready or unready, or changes its DHT id.
        self.version = 0
        self._committed = (committed_round, committed_hash)
        self._leases: list[tuple[float, str]] = []  # (lease expiry, peer id); stale entries are skipped
        self._ready: dict[str, int] = {}  # ready peer id -> peer index
        self._ready_sorted: Optional[list[str]] = []
        self._indexes: list[int] = []  # every peer's index, ascending
        self._by_index: dict[int, str] = {}  # peer index -> peer id
        self._gone: list[tuple[float, str]] = []  # (last seen, peer id) of the gone peers, ascending
        self.sums: dict[str, float] = dict.fromkeys(SUMMED_METRICS, 0)  # the metrics of every peer, added up
        for peer in peers:
            self.put(peer)

    @property
    def committed(self) -> tuple[int, str]:
        return self._committed

    def put(self, peer: PeerRecord) -> None:
        old = self.peers.get(peer.peer_id)
        self.peers[peer.peer_id] = peer
        if peer.peer_index not in self._by_index:
            bisect.insort(self._indexes, peer.peer_index)
        self._by_index[peer.peer_index] = peer.peer_id
        if old is not None and not old.alive:
            at = bisect.bisect_left(self._gone, (old.last_seen, old.peer_id))
            if at < len(self._gone) and self._gone[at] == (old.last_seen, old.peer_id):
                del self._gone[at]
        if not peer.alive:
            bisect.insort(self._gone, (peer.last_seen, peer.peer_id))
        if old is None or old.metrics is not peer.metrics:
            for name in SUMMED_METRICS:
                self.sums[name] += getattr(peer.metrics, name) - (getattr(old.metrics, name) if old else 0)
        if peer.alive and (old is None or old.lease_expiry != peer.lease_expiry or not old.alive):
            heapq.heappush(self._leases, (peer.lease_expiry, peer.peer_id))
        self.live += _alive(peer) - _alive(old)
        if peer.alive:
            self.alive_ids.add(peer.peer_id)
        else:
            self.alive_ids.discard(peer.peer_id)
        self.behind += self._behind(peer) - self._behind(old)
        ready = self._is_ready(peer)
        if ready != (peer.peer_id in self._ready):
            if ready:
                self._ready[peer.peer_id] = peer.peer_index
            else:
                del self._ready[peer.peer_id]
            self._ready_sorted = None
            self.version += 1
        elif old is None or old.alive != peer.alive or old.metrics.dht_peer_id != peer.metrics.dht_peer_id:
            self.version += 1

    def recount(self, peers: Iterable[PeerRecord]) -> None:
        """Keep ``peers``, each the same as its record here but for its rounds counters (``membership.counted_rounds``),
        which nothing else here indexes or depends on."""
        for peer in peers:
            self.peers[peer.peer_id] = peer

    def gone_before(self, when: float) -> int:
        """How many peers are gone and were last seen before ``when``."""
        return bisect.bisect_left(self._gone, (when, ""))

    def dht_addresses(self) -> list[str]:
        """The DHT addresses of the peers not known to be gone: a restarted coordinator's DHT node dials
        them, so the overlay the peers kept up meanwhile and the peers that join through it are one."""
        return [m for p in self.peers.values() if p.alive for m in p.metrics.dht_maddrs]

    def is_live_member(self, dht_peer_id: str) -> bool:
        """Whether a libp2p id is a live member's (proven at its join)."""
        return any(p.alive and p.dht_peer_id == dht_peer_id for p in self.peers.values())

    def page(self, from_index: int, size: int, listed: Callable[[PeerRecord], bool]) -> tuple[list[PeerRecord], int]:
        """Up to ``size`` peers for which ``listed`` holds, by index from ``from_index``; and the index to go on
        from (-1: none left)."""
        found: list[PeerRecord] = []
        for position in range(bisect.bisect_left(self._indexes, from_index), len(self._indexes)):
            index = self._indexes[position]
            if len(found) == size:
                return found, index
            peer = self.peers[self._by_index[index]]
            if listed(peer):
                found.append(peer)
        return found, -1

    def expired(self, now: float) -> list[PeerRecord]:
        """The live peers whose lease ran out before ``now`` (as they are; the caller evicts them)."""
        found = []
        while self._leases and self._leases[0][0] < now:
            expiry, peer_id = heapq.heappop(self._leases)
            peer = self.peers.get(peer_id)
            if peer is not None and peer.alive and peer.lease_expiry == expiry:
                found.append(peer)
        return found

    def set_committed(self, committed_round: int, committed_hash: str) -> None:
        """The run's last committed state changed: who is ready and who is behind, counted afresh."""
        if (committed_round, committed_hash) == self._committed:
            return
        self._committed = (committed_round, committed_hash)
        self._ready = {p.peer_id: p.peer_index for p in self.peers.values() if self._is_ready(p)}
        self._ready_sorted = None
        self.behind = sum(1 for p in self.peers.values() if self._behind(p))
        self.version += 1

    def ready_ids(self) -> list[str]:
        """Ids of the ready peers, in joining order (a fresh list the caller may keep)."""
        if self._ready_sorted is None:
            self._ready_sorted = sorted(self._ready, key=self._ready.__getitem__)
        return list(self._ready_sorted)

    def _is_ready(self, peer: PeerRecord) -> bool:
        return membership.is_ready(peer, *self._committed)

    def _behind(self, peer: Optional[PeerRecord]) -> bool:
        return peer is not None and peer.alive and peer.metrics.state_round < self._committed[0]


def _alive(peer: Optional[PeerRecord]) -> int:
    return int(peer is not None and peer.alive)
