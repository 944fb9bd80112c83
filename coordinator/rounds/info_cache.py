"""The RoundInfo answers, kept between calls: every heartbeat asks for the current round's, a peer awaiting a
decision polls for its round's, and they change only when the rounds or the peers they list change.

An answer's cost and size do not grow with the swarm:

- its holders are kept apart, and an answer names a bounded sample of them (``views.holder_sample``);
- a round of more than ``LISTED_PARTICIPANTS`` participants is answered with the requester's own entries of its
  per-participant lists (participants, their libp2p ids, the plan's budgets and left-out peers) and
  ``participant_count``; the controller's shares go whole to everyone (a round planned with more participants
  has none: ``coordinator.rounds.controller``; late admissions are not in them), so every member derives the same
  slices and choice digest; a smaller round lists them all, except in a heartbeat's answer (``own_only``),
  whose reader looks only at its own (whether it was planned or left out);
- the rest of an answer is encoded once per build: a GetRound answer over gRPC is that cached encoding followed by
  the encoding of what differs per call (its own entries, holders, counters, the poll pace), which protobuf
  merges as one message;
- in a swarm of more than ``LISTED_PARTICIPANTS`` live peers, where peers come and go and turn ready all the time,
  an answer is built again at most every ``REFRESH_S`` (its holders and its round's live participants that old at
  most), and at once only when a fact a peer acts on changed: a round opened or was decided, the run finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Optional

from coordinator.api.limits import LISTED_PARTICIPANTS
from coordinator.api.views import RunPosition, holder_sample, round_info
from coordinator.roster import Roster
from coordinator.store.records import PeerRecord, RoundRecord
from swarm.v1 import coordinator_pb2 as pb

MAX_ROUNDS_KEPT = 4  # answers of other rounds than the current one kept (peers poll the round they reported)
REFRESH_S = 1.0  # in a swarm of more live peers than LISTED_PARTICIPANTS: the longest an answer is kept


@dataclass
class _Built:
    """One round's answer as built, split into what every requester gets and each one's own entries."""

    key: tuple[Hashable, ...]  # the versions it was built at
    facts: Hashable  # what makes it stale at once, whatever the swarm's size
    built_at: float
    info: pb.RoundInfo  # without holders; for a large round without the per-participant lists either
    holders: tuple[str, ...]
    large: bool  # more participants than LISTED_PARTICIPANTS
    places: dict[str, int] = field(default_factory=dict)  # participant -> its place in the lists
    dht_ids: list[str] = field(default_factory=list)
    plan_peers: dict[str, pb.PlannedPeer] = field(default_factory=dict)
    left_out: frozenset[str] = frozenset()  # a large round's (a small one's stay in info)
    _slim: Optional[pb.RoundInfo] = None
    _encoding: Optional[bytes] = None

    @classmethod
    def of(cls, built: pb.RoundInfo, key: tuple[Hashable, ...], facts: Hashable, now: float) -> "_Built":
        holders = tuple(built.holders)
        del built.holders[:]
        count = len(built.participants)
        built.participant_count = count
        entry = cls(
            key=key,
            facts=facts,
            built_at=now,
            info=built,
            holders=holders,
            large=count > LISTED_PARTICIPANTS,
            places={p: i for i, p in enumerate(built.participants)},
            dht_ids=list(built.participant_dht_ids),
            plan_peers={p.peer_id: p for p in built.plan.peers},
        )
        if entry.large:
            entry.left_out = frozenset(built.plan.left_out)
            entry.info = _without_lists(built, left_out=True)
        return entry

    def slim(self) -> pb.RoundInfo:
        """The answer without the per-participant lists, to which a requester's own entries are added."""
        if self.large:
            return self.info
        if self._slim is None:
            self._slim = _without_lists(self.info, left_out=False)
        return self._slim

    def encoding(self) -> bytes:
        if self._encoding is None:
            self._encoding = self.info.SerializeToString()
        return self._encoding

    def own_entries(self, requester: str, into: pb.RoundInfo) -> None:
        """Add ``requester``'s own entries of the per-participant lists to ``into``."""
        place = self.places.get(requester)
        if place is not None:
            into.participants.append(requester)
            if place < len(self.dht_ids):
                into.participant_dht_ids.append(self.dht_ids[place])
            if requester in self.plan_peers:
                into.plan.peers.append(self.plan_peers[requester])
        if requester in self.left_out:
            into.plan.left_out.append(requester)


def _without_lists(info: pb.RoundInfo, *, left_out: bool) -> pb.RoundInfo:
    slim = pb.RoundInfo()
    slim.CopyFrom(info)
    del slim.participants[:], slim.participant_dht_ids[:]
    if info.HasField("plan"):
        del slim.plan.peers[:]
        if left_out:
            del slim.plan.left_out[:]
    return slim


class RoundInfoCache:
    """Owned by the engine, used under its lock only; ``roster`` is the engine's, read for its counters and size."""

    def __init__(self, roster: Roster) -> None:
        self._roster = roster
        self._current: Optional[_Built] = None
        self._rounds: dict[int, _Built] = {}  # round -> its answer, for the last few rounds asked about

    def current(
        self,
        versions: tuple[int, int],
        row: Optional[RoundRecord],
        position: Callable[[], RunPosition],
        peers: Mapping[str, PeerRecord],
        *,
        requester: str = "",
        own_only: bool = False,
        now: float = 0.0,
        facts: Hashable = None,
    ) -> pb.RoundInfo:
        """A copy of the RoundInfo of ``row`` (round 0 when None) as ``requester`` (a peer id) gets it, built again
        only when it is stale (``versions`` of the roster and the rounds changed; in a large swarm ``facts`` changed
        or ``REFRESH_S`` passed since ``now`` of its build); ``own_only``: with the requester's own entries of the
        per-participant lists only."""
        built = self._current_base(
            versions, lambda: round_info(row.round if row else 0, row, position(), peers), now=now, facts=facts
        )
        return self._answer(built, requester, own_only=own_only)

    def encoded(
        self,
        versions: tuple[int, int],
        number: int,
        build: Callable[[], pb.RoundInfo],
        *,
        requester: str,
        poll_interval_s: float,
        now: float = 0.0,
        facts: Hashable = None,
    ) -> bytes:
        """The encoding of round ``number``'s RoundInfo (0: the current one, which ``build`` then makes) as
        ``requester`` gets it, with ``poll_interval_s``: what ``current`` and ``of_round`` answer, encoded."""
        if number == 0:
            built = self._current_base(versions, build, now=now, facts=facts)
        else:
            built = self._round_base(versions, number, build, now=now, facts=facts)
        per_call = pb.RoundInfo(
            holders=holder_sample(built.holders, requester, round_no=built.info.round), poll_interval_s=poll_interval_s
        )
        if built.large:
            built.own_entries(requester, per_call)
        return built.encoding() + self.counted(per_call).SerializeToString()

    def of_round(
        self,
        versions: tuple[int, int],
        number: int,
        build: Callable[[], pb.RoundInfo],
        *,
        requester: str = "",
        now: float = 0.0,
        facts: Hashable = None,
    ) -> pb.RoundInfo:
        """A copy of round ``number``'s RoundInfo (``build()`` makes it) as ``requester`` gets it; the answers of
        the last few rounds asked for are kept while they are fresh (as ``current``'s)."""
        return self._answer(self._round_base(versions, number, build, now=now, facts=facts), requester)

    def counted(self, info: pb.RoundInfo) -> pb.RoundInfo:
        # a holder of the final state stays to serve it while the peers behind catch up (peer: _serve_final_state)
        info.live_peers, info.behind_peers = self._roster.live, self._roster.behind
        return info

    # ---- internals -----------------------------------------------------------------------------------

    def _answer(self, built: _Built, requester: str, *, own_only: bool = False) -> pb.RoundInfo:
        info = pb.RoundInfo()
        if built.large or own_only:
            info.CopyFrom(built.slim())
            built.own_entries(requester, info)
        else:
            info.CopyFrom(built.info)
        info.holders.extend(holder_sample(built.holders, requester, round_no=info.round))
        return self.counted(info)

    def _fresh(self, built: Optional[_Built], key: tuple[Hashable, ...], facts: Hashable, now: float) -> bool:
        if built is None:
            return False
        if built.key == key:
            return True
        return (
            self._roster.live > LISTED_PARTICIPANTS and built.facts == facts and 0 <= now - built.built_at < REFRESH_S
        )

    def _current_base(
        self, versions: tuple[int, int], build: Callable[[], pb.RoundInfo], *, now: float, facts: Hashable
    ) -> _Built:
        if not self._fresh(self._current, versions, facts, now):
            self._current = _Built.of(build(), versions, facts, now)
        return self._current

    def _round_base(
        self, versions: tuple[int, int], number: int, build: Callable[[], pb.RoundInfo], *, now: float, facts: Hashable
    ) -> _Built:
        built = self._rounds.get(number)
        if not self._fresh(built, versions, facts, now):
            self._rounds.pop(number, None)
            if len(self._rounds) >= MAX_ROUNDS_KEPT:
                self._rounds.pop(next(iter(self._rounds)))
            built = self._rounds[number] = _Built.of(build(), versions, facts, now)
        return built
