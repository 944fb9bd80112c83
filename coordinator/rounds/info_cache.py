"""The RoundInfo answers, kept between calls: every heartbeat asks for the current round's, a peer awaiting a
decision polls for its round's, and they change only when the rounds or the peers they list change. Its holders are kept apart, so an answer copies
the rest and names a bounded sample of them (``views.holder_sample``): its cost does not grow with the
number of peers that hold the state."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from coordinator.api.views import RunPosition, holder_sample, round_info
from coordinator.roster import Roster
from coordinator.store.records import PeerRecord, RoundRecord
from swarm.v1 import coordinator_pb2 as pb

MAX_ROUNDS_KEPT = 4  # answers of other rounds than the current one kept (peers poll the round they reported)


class RoundInfoCache:
    """Owned by the engine, used under its lock only; ``roster`` is the engine's, read for its counters."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster
        # (versions, the answer without holders, its holders)
        self._cached: Optional[tuple[tuple[int, int], pb.RoundInfo, tuple[str, ...]]] = None
        self._rounds: dict[int, tuple[pb.RoundInfo, tuple[str, ...]]] = {}  # round -> as _cached, of these versions:
        self._rounds_versions: Optional[tuple[int, int]] = None

    def current(
        self, versions: tuple[int, int], row: Optional[RoundRecord], position: Callable[[], RunPosition],
        peers: Mapping[str, PeerRecord], *, requester: str = "",
    ) -> pb.RoundInfo:
        """A copy of the RoundInfo of ``row`` (round 0 when None) as ``requester`` (a peer id) gets it,
        built again only when ``versions`` (of the roster and the rounds) changed since it was last built."""
        if self._cached is None or self._cached[0] != versions:
            built = round_info(row.round if row else 0, row, position(), peers)
            holders = tuple(built.holders)
            del built.holders[:]
            self._cached = versions, built, holders
        _, cached, holders = self._cached
        info = pb.RoundInfo()
        info.CopyFrom(cached)
        info.holders.extend(holder_sample(holders, requester, round_no=info.round))
        return self.counted(info)

    def of_round(self, versions: tuple[int, int], number: int, build: Callable[[], pb.RoundInfo], *,
                 requester: str = "") -> pb.RoundInfo:
        """A copy of round ``number``'s RoundInfo (``build()`` makes it) as ``requester`` gets it; the answers of
        the last few rounds asked for are kept while ``versions`` stay the same."""
        if self._rounds_versions != versions:
            self._rounds, self._rounds_versions = {}, versions
        if number not in self._rounds:
            if len(self._rounds) >= MAX_ROUNDS_KEPT:
                self._rounds.pop(next(iter(self._rounds)))
            built = build()
            holders = tuple(built.holders)
            del built.holders[:]
            self._rounds[number] = built, holders
        cached, holders = self._rounds[number]
        info = pb.RoundInfo()
        info.CopyFrom(cached)
        info.holders.extend(holder_sample(holders, requester, round_no=number))
        return self.counted(info)

    def counted(self, info: pb.RoundInfo) -> pb.RoundInfo:
        # a holder of the final state stays to serve it while the peers behind catch up (peer: _serve_final_state)
        info.live_peers, info.behind_peers = self._roster.live, self._roster.behind
        return info
