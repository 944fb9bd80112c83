"""The RoundInfo answers, kept between calls: every heartbeat asks for the current round's, a peer awaiting a
decision polls for its round's, and they change only when the rounds or the peers they list change.

An answer's cost and size do not grow with the swarm:

- its holders are kept apart, and an answer names a bounded sample of them (``views.holder_sample``);
- a round of more than ``LISTED_PARTICIPANTS`` participants is answered with the requester's own entries of its
  per-participant lists (participants, their libp2p ids, the plan's budgets and left-out peers), looked up in the
  round's record as it is asked, and ``participant_count``: its build makes no lists; the controller's shares go whole to everyone (a round planned with more participants
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
from typing import Hashable, Optional

from coordinator.api.limits import LISTED_PARTICIPANTS
from coordinator.api.views import holder_sample, round_info
from coordinator.rounds.run_state import RunState
from coordinator.store.records import OPEN, PeerRecord, RoundRecord
from swarm.v1 import coordinator_pb2 as pb

MAX_ROUNDS_KEPT = 4  # answers of other rounds than the current one kept (peers poll the round they reported)
REFRESH_S = 1.0  # in a swarm of more live peers than LISTED_PARTICIPANTS: the longest an answer is kept


@dataclass
class _Listed:
    """A large round's per-participant lists, kept as its record has them: each requester's own entries are looked
    up as it asks."""

    row: RoundRecord
    members: frozenset[str]  # the participants its answer names: an open round's live ones, a decided one's all
    peers: dict[str, PeerRecord]  # the engine's (an open round's libp2p ids are read from them)
    places: dict[str, int] = field(default_factory=dict)  # participant -> its place in the record (for its budget)
    left_out: frozenset[str] = frozenset()

    @classmethod
    def of(cls, row: RoundRecord, members: frozenset[str], peers: dict[str, PeerRecord]) -> "_Listed":
        budgeted = bool(row.budgets or row.left_out) and len(row.budgets) == len(row.participants)
        places = {p: i for i, p in enumerate(row.participants)} if budgeted else {}
        left_out = frozenset(row.left_out) if row.budgets or row.left_out else frozenset()
        return cls(row, members, peers, places, left_out)

    def own_entries(self, requester: str, into: pb.RoundInfo) -> None:
        if requester in self.members:
            into.participants.append(requester)
            if self.row.outcome == OPEN:
                into.participant_dht_ids.append(self.peers[requester].dht_peer_id)
        place = self.places.get(requester)
        if place is not None:
            row = self.row
            into.plan.peers.append(
                pb.PlannedPeer(peer_id=requester, inner_steps=row.budgets[place], step_time_s=row.step_times_s[place])
            )
        if requester in self.left_out:
            into.plan.left_out.append(requester)


@dataclass
class _Built:
    """One round's answer as built: what every requester gets, and (a small round) its lists whole or (a large
    one) where each requester's own entries are looked up."""

    key: tuple[Hashable, ...]  # the versions it was built at
    facts: Hashable  # what makes it stale at once, whatever the swarm's size
    built_at: float
    info: pb.RoundInfo  # without holders; for a large round without the per-participant lists either
    holders: tuple[str, ...]
    listed: Optional[_Listed] = None  # a large round's (more participants than LISTED_PARTICIPANTS)
    _slim: Optional[pb.RoundInfo] = None
    _encoding: Optional[bytes] = None

    @property
    def large(self) -> bool:
        return self.listed is not None

    @classmethod
    def of(
        cls, built: pb.RoundInfo, key: tuple[Hashable, ...], facts: Hashable, now: float, listed: Optional[_Listed]
    ) -> "_Built":
        holders = tuple(built.holders)
        del built.holders[:]
        built.participant_count = len(listed.members) if listed is not None else len(built.participants)
        return cls(key=key, facts=facts, built_at=now, info=built, holders=holders, listed=listed)

    def slim(self) -> pb.RoundInfo:
        """The answer without the per-participant lists, to which a requester's own entries are added."""
        if self.large:
            return self.info
        if self._slim is None:
            self._slim = _without_lists(self.info)
        return self._slim

    def encoding(self) -> bytes:
        if self._encoding is None:
            self._encoding = self.info.SerializeToString()
        return self._encoding

    def own_entries(self, requester: str, into: pb.RoundInfo) -> None:
        """Add ``requester``'s own entries of the per-participant lists to ``into``."""
        if self.listed is not None:
            self.listed.own_entries(requester, into)
            return
        info = self.info
        place = next((i for i, p in enumerate(info.participants) if p == requester), None)
        if place is not None:
            into.participants.append(requester)
            if place < len(info.participant_dht_ids):
                into.participant_dht_ids.append(info.participant_dht_ids[place])
        for planned in info.plan.peers:
            if planned.peer_id == requester:
                into.plan.peers.append(planned)
                break


def _without_lists(info: pb.RoundInfo) -> pb.RoundInfo:
    slim = pb.RoundInfo()
    slim.CopyFrom(info)
    del slim.participants[:], slim.participant_dht_ids[:]
    if info.HasField("plan"):
        del slim.plan.peers[:]
    return slim


class RoundInfoCache:
    """Owned by the engine, used under its lock only; ``state`` is the engine's, whose rounds, peers and counters
    the answers are built from."""

    def __init__(self, state: RunState) -> None:
        self._state = state
        self._current: Optional[_Built] = None
        self._rounds: dict[int, _Built] = {}  # round -> its answer, for the last few rounds asked about

    def current(self, *, requester: str = "", own_only: bool = False, now: float = 0.0) -> pb.RoundInfo:
        """A copy of the current round's RoundInfo (the open round, or the latest decided one when none is open;
        round 0 before any) as ``requester`` (a peer id) gets it, built again only when it is stale (the versions of
        the roster and the rounds changed; in a large swarm ``_facts`` changed or ``REFRESH_S`` passed since ``now`` of
        its build); ``own_only``: with the requester's own entries of the per-participant lists only."""
        return self._answer(self._base(0, now), requester, own_only=own_only)

    def encoded(self, number: int, *, requester: str, poll_interval_s: float, now: float = 0.0) -> bytes:
        """The encoding of round ``number``'s RoundInfo (0: the current one) as ``requester`` gets it, with
        ``poll_interval_s``: what ``current`` and ``of_round`` answer, encoded."""
        built = self._base(number, now)
        per_call = pb.RoundInfo(
            holders=holder_sample(built.holders, requester, round_no=built.info.round), poll_interval_s=poll_interval_s
        )
        if built.large:
            built.own_entries(requester, per_call)
        return built.encoding() + self.counted(per_call).SerializeToString()

    def of_round(self, number: int, *, requester: str = "", now: float = 0.0) -> pb.RoundInfo:
        """A copy of round ``number``'s RoundInfo as ``requester`` gets it; the answers of the last few rounds asked
        for are kept while they are fresh (as ``current``'s)."""
        return self._answer(self._base(number, now), requester)

    def counted(self, info: pb.RoundInfo) -> pb.RoundInfo:
        # a holder of the final state stays to serve it while the peers behind catch up (peer: _serve_final_state)
        roster = self._state.roster
        info.live_peers, info.behind_peers = roster.live, roster.behind
        return info

    # ---- internals -----------------------------------------------------------------------------------

    def _build(self, number: int, key: tuple[Hashable, ...], facts: Hashable, now: float) -> _Built:
        """Round ``number``'s answer (0: the current round's); a large round's without its lists (``_Listed``)."""
        state = self._state
        row = (state.open or state.latest) if number == 0 else state.round_row(number)
        if number == 0:
            number = row.round if row is not None else 0
        listed = None
        if row is not None and len(row.participants) > LISTED_PARTICIPANTS:
            members = (
                frozenset(state.roster.alive_ids.intersection(row.participants))
                if row.outcome == OPEN
                else frozenset(row.participants)
            )
            if len(members) > LISTED_PARTICIPANTS:
                listed = _Listed.of(row, members, state.peers)
        info = round_info(number, row, state.position(), state.peers, listed=listed is None)
        return _Built.of(info, key, facts, now, listed)

    def _answer(self, built: _Built, requester: str, *, own_only: bool = False) -> pb.RoundInfo:
        info = pb.RoundInfo()
        if built.large or own_only:
            info.CopyFrom(built.slim())
            built.own_entries(requester, info)
        else:
            info.CopyFrom(built.info)
        info.holders.extend(holder_sample(built.holders, requester, round_no=info.round))
        return self.counted(info)

    def _facts(self) -> Hashable:
        """What a peer acts on as soon as it changes: a cached answer is built again at once when it did, however
        large the swarm: the latest round and its outcome, the last commit, the run's end."""
        state = self._state
        latest = state.latest
        return (
            (latest.round, latest.outcome) if latest is not None else None,
            state.last_committed_state()[0],
            state.run.finished,
        )

    def _fresh(self, built: Optional[_Built], key: tuple[Hashable, ...], facts: Hashable, now: float) -> bool:
        if built is None:
            return False
        if built.key == key:
            return True
        return (
            self._state.roster.live > LISTED_PARTICIPANTS
            and built.facts == facts
            and 0 <= now - built.built_at < REFRESH_S
        )

    def _base(self, number: int, now: float) -> _Built:
        """Round ``number``'s answer (0: the current round's), built again when stale; the answers of the last few
        other rounds asked about are kept."""
        key, facts = self._state.versions()[:2], self._facts()  # reports change neither
        if number == 0:
            if not self._fresh(self._current, key, facts, now):
                self._current = self._build(0, key, facts, now)
            return self._current
        built = self._rounds.get(number)
        if not self._fresh(built, key, facts, now):
            self._rounds.pop(number, None)
            if len(self._rounds) >= MAX_ROUNDS_KEPT:
                self._rounds.pop(next(iter(self._rounds)))
            built = self._rounds[number] = self._build(number, key, facts, now)
        return built
