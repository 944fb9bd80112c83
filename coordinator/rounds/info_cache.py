"""The RoundInfo answers, kept between calls: every heartbeat asks for the current round's, a peer awaiting a
decision polls for its round's, and they change only when the rounds or the peers they list change. Its holders are kept apart, so an answer copies
the rest and names a bounded sample of them (``views.holder_sample``): its cost does not grow with the
number of peers that hold the state. A heartbeat's answer is slimmer still (``own_only``): of the round's
participants, their libp2p ids and the plan's per-peer budgets it names only the caller's own, which is all a
heartbeat's reader looks at (whether it was left out, whether the round went on without it), so it costs the same
in a round of ten peers or ten thousand. A GetRound answer over gRPC is its cached encoding followed by the
encoding of what differs per call (holders, counters, the poll pace): protobuf merges the two as one message."""

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
        self._slim: Optional[pb.RoundInfo] = None  # the cached answer without its per-participant lists
        self._places: dict[str, int] = {}  # participant -> its place in the cached answer's lists
        self._rounds: dict[int, tuple[pb.RoundInfo, tuple[str, ...]]] = {}  # round -> as _cached, of these versions:
        self._rounds_versions: Optional[tuple[int, int]] = None
        self._encodings: dict[int, tuple[pb.RoundInfo, bytes]] = {}  # id(cached answer) -> (it, its encoding)

    def current(
        self, versions: tuple[int, int], row: Optional[RoundRecord], position: Callable[[], RunPosition],
        peers: Mapping[str, PeerRecord], *, requester: str = "", own_only: bool = False,
    ) -> pb.RoundInfo:
        """A copy of the RoundInfo of ``row`` (round 0 when None) as ``requester`` (a peer id) gets it,
        built again only when ``versions`` (of the roster and the rounds) changed since it was last built;
        ``own_only``: with the requester's own entries of the per-participant lists only."""
        cached, holders = self._current_base(
            versions, lambda: round_info(row.round if row else 0, row, position(), peers))
        info = pb.RoundInfo()
        info.CopyFrom(self._own_entries(requester) if own_only else cached)
        info.holders.extend(holder_sample(holders, requester, round_no=info.round))
        return self.counted(info)

    def encoded(self, versions: tuple[int, int], number: int, build: Callable[[], pb.RoundInfo], *,
                requester: str, poll_interval_s: float) -> bytes:
        """The encoding of round ``number``'s RoundInfo (0: the current one, which ``build`` then makes) as
        ``requester`` gets it, with ``poll_interval_s``: what ``current`` and ``of_round`` answer, encoded."""
        if number == 0:
            cached, holders = self._current_base(versions, build)
        else:
            cached, holders = self._round_base(versions, number, build)
        if id(cached) not in self._encodings:  # forget the encodings of answers no longer cached
            kept = [self._cached[1]] if self._cached is not None else []
            kept += [answer for answer, _ in self._rounds.values()]
            self._encodings = {key: (answer, data) for key, (answer, data) in self._encodings.items()
                               if any(answer is k for k in kept)}
            self._encodings[id(cached)] = cached, cached.SerializeToString()
        per_call = self.counted(pb.RoundInfo(holders=holder_sample(holders, requester, round_no=cached.round),
                                             poll_interval_s=poll_interval_s))
        return self._encodings[id(cached)][1] + per_call.SerializeToString()

    def _current_base(self, versions: tuple[int, int],
                      build: Callable[[], pb.RoundInfo]) -> tuple[pb.RoundInfo, tuple[str, ...]]:
        if self._cached is None or self._cached[0] != versions:
            built = build()
            holders = tuple(built.holders)
            del built.holders[:]
            self._cached, self._slim = (versions, built, holders), None
        return self._cached[1], self._cached[2]

    def _own_entries(self, requester: str) -> pb.RoundInfo:
        assert self._cached is not None
        cached = self._cached[1]
        if self._slim is None:
            self._slim = pb.RoundInfo()
            self._slim.CopyFrom(cached)
            del self._slim.participants[:], self._slim.participant_dht_ids[:], self._slim.plan.peers[:]
            if not cached.HasField("plan"):
                self._slim.ClearField("plan")
            self._places = {p: i for i, p in enumerate(cached.participants)}
        place = self._places.get(requester)
        if place is None:
            return self._slim
        own = pb.RoundInfo()
        own.CopyFrom(self._slim)
        own.participants.append(requester)
        if place < len(cached.participant_dht_ids):
            own.participant_dht_ids.append(cached.participant_dht_ids[place])
        own.plan.peers.extend(p for p in cached.plan.peers if p.peer_id == requester)
        if not cached.HasField("plan"):
            own.ClearField("plan")
        return own

    def of_round(self, versions: tuple[int, int], number: int, build: Callable[[], pb.RoundInfo], *,
                 requester: str = "") -> pb.RoundInfo:
        """A copy of round ``number``'s RoundInfo (``build()`` makes it) as ``requester`` gets it; the answers of
        the last few rounds asked for are kept while ``versions`` stay the same."""
        cached, holders = self._round_base(versions, number, build)
        info = pb.RoundInfo()
        info.CopyFrom(cached)
        info.holders.extend(holder_sample(holders, requester, round_no=number))
        return self.counted(info)

    def _round_base(self, versions: tuple[int, int], number: int,
                    build: Callable[[], pb.RoundInfo]) -> tuple[pb.RoundInfo, tuple[str, ...]]:
        if self._rounds_versions != versions:
            self._rounds, self._rounds_versions = {}, versions
        if number not in self._rounds:
            if len(self._rounds) >= MAX_ROUNDS_KEPT:
                self._rounds.pop(next(iter(self._rounds)))
            built = build()
            holders = tuple(built.holders)
            del built.holders[:]
            self._rounds[number] = built, holders
        return self._rounds[number]

    def counted(self, info: pb.RoundInfo) -> pb.RoundInfo:
        # a holder of the final state stays to serve it while the peers behind catch up (peer: _serve_final_state)
        info.live_peers, info.behind_peers = self._roster.live, self._roster.behind
        return info
