"""The peer's lifecycle as one table: its states, the events that move it, and the one function that picks the
next event from what the peer knows. ``peer.daemon`` runs the transition each event names; nothing else decides
one.

    state × event → state (TRANSITIONS below; a pair not in it is a bug, and raises)

    JOINING ─→ SYNCING ─→ READY ⇄ TRAINING ─→ EXCHANGING ─→ DECIDING ─→ READY (or SYNCING when behind)
                            │         └─ (coordinator unreachable) OFFLINE_DECIDING: the group decides;
                            │            the rounds it decided are reported once the coordinator is back
                            └─→ FINISHING (the run is over: write the final model, serve it) ─→ LEAVING

The main thread owns the state: the daemon's loop and the round hooks it runs (``exchanging``, ``deciding``)
are the only callers of ``after``.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Optional

from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


class PeerState(enum.Enum):
    JOINING = "joining"
    SYNCING = "syncing"
    READY = "ready"
    TRAINING = "training"
    EXCHANGING = "exchanging"  # set by the round hooks; the exchange runs on the runner's executor
    DECIDING = "deciding"
    OFFLINE_DECIDING = "offline-deciding"
    FINISHING = "finishing"
    LEAVING = "leaving"


# what the coordinator sees of a state (the deciding ones keep showing EXCHANGING)
WIRE_STATES = {
    PeerState.JOINING: pb.PEER_STATE_JOINING,
    PeerState.SYNCING: pb.PEER_STATE_JOINING,
    PeerState.READY: pb.PEER_STATE_READY,
    PeerState.TRAINING: pb.PEER_STATE_TRAINING,
    PeerState.EXCHANGING: pb.PEER_STATE_EXCHANGING,
}


class Event(enum.Enum):
    # picked by ``next_event`` from what the peer knows, once per pass of the daemon's loop
    REJECTED = "rejected"  # the coordinator refused this peer (its heartbeat says why): exit 2
    CARRIED = "carried"  # a round's exchange overlaps the next round's first steps: train that round
    GROUP_GOES_ON = "group-goes-on"  # the coordinator is unreachable; the group runs its next round without it
    COORDINATOR_DOWN = "coordinator-down"  # unreachable, and nothing to do without it: wait for it (with backoff)
    BACKLOG = "backlog"  # the coordinator is back: report the rounds the group decided without it
    BEHIND = "behind"  # a committed state this peer does not hold (or its group's decision was contradicted)
    FINISHED = "finished"  # the run is over and this peer holds its final state
    PLANNED = "planned"  # this peer is a participant of the open round
    UNPLANNED = "unplanned"  # no open round for this peer yet: wait at the coordinator's pace
    # what a round reports as it runs (the round hooks, on the main thread)
    EXCHANGE = "exchange"  # the round's exchange started
    DECIDE = "decide"  # the exchange ended; the round awaits its decision (the group's, offline)
    ROUND_ENDED = "round-ended"  # committed, voided, behind or not planned: the next pass picks what follows
    # ends
    SYNC_FAILED_AT_END = "stranded"  # the run finished, this peer could not get its final state and no holder is left
    STOP = "stop"  # SIGTERM, a rejection, an exit: leave


_ROUND = (PeerState.TRAINING, PeerState.EXCHANGING, PeerState.DECIDING, PeerState.OFFLINE_DECIDING)
_BETWEEN = (PeerState.READY, PeerState.SYNCING, PeerState.JOINING, *_ROUND)  # where a loop pass may start
_ALL = tuple(PeerState)


def _each(states: tuple[PeerState, ...], event: Event, to: Optional[PeerState]) -> dict:
    """``to`` from each of ``states`` (None: the state stays)."""
    return {(s, event): (s if to is None else to) for s in states}


TRANSITIONS: dict[tuple[PeerState, Event], PeerState] = {
    **_each(_BETWEEN, Event.REJECTED, PeerState.LEAVING),
    **_each(_BETWEEN, Event.CARRIED, PeerState.TRAINING),  # a round in flight: the next round trains at once
    **_each(_BETWEEN, Event.GROUP_GOES_ON, PeerState.TRAINING),
    **_each(_BETWEEN, Event.COORDINATOR_DOWN, None),  # waiting changes nothing the coordinator would see
    **_each(_BETWEEN, Event.BACKLOG, None),  # reported from whatever it holds; BEHIND follows if it was contradicted
    **_each(_BETWEEN, Event.BEHIND, PeerState.SYNCING),
    **_each(_BETWEEN, Event.FINISHED, PeerState.FINISHING),
    **_each(_BETWEEN, Event.PLANNED, PeerState.TRAINING),
    **_each(_BETWEEN, Event.UNPLANNED, PeerState.READY),
    (PeerState.TRAINING, Event.EXCHANGE): PeerState.EXCHANGING,
    (PeerState.EXCHANGING, Event.EXCHANGE): PeerState.EXCHANGING,  # fragments: one exchange after another
    (PeerState.DECIDING, Event.EXCHANGE): PeerState.EXCHANGING,  # the carried round decided, the next one exchanges
    (PeerState.OFFLINE_DECIDING, Event.EXCHANGE): PeerState.EXCHANGING,
    **_each(_ROUND, Event.DECIDE, PeerState.DECIDING),
    **_each(_ROUND, Event.ROUND_ENDED, PeerState.READY),
    (PeerState.SYNCING, Event.SYNC_FAILED_AT_END): PeerState.LEAVING,
    **_each(_ALL, Event.STOP, PeerState.LEAVING),
}


class BadTransition(RuntimeError):
    """The daemon asked for a pair the table does not have: a bug in the daemon, not the run's doing."""


def after(state: PeerState, event: Event, *, offline: bool = False, strict: bool = True) -> PeerState:
    """The state ``event`` moves ``state`` to; a decision during a round run without the coordinator is
    OFFLINE_DECIDING. A pair the table lacks raises ``BadTransition``; with ``strict=False`` (a running peer) it
    is logged as the bug it is and the peer goes on where the event leads from READY (from TRAINING for a round's
    own events)."""
    to = TRANSITIONS.get((state, event))
    if to is None:
        problem = BadTransition(f"the peer's lifecycle has no transition from {state.name} on {event.name}")
        if strict:
            raise problem
        logger.error("%s", problem)
        to = TRANSITIONS[(PeerState.TRAINING if event in (Event.EXCHANGE, Event.DECIDE) else PeerState.READY, event)]
    return PeerState.OFFLINE_DECIDING if to is PeerState.DECIDING and offline else to


@dataclass(frozen=True)
class View:
    """What the peer knows at the start of a loop pass; ``info`` is None while the coordinator is unreachable."""

    rejected: bool = False  # its heartbeat was refused
    carrying: bool = False  # a round's exchange is in flight, overlapping the next round
    info: Optional[pb.RoundInfo] = None  # the coordinator's answer this pass
    final_known: bool = False  # the coordinator said the run finished (and may be gone since)
    offline_next: Optional[int] = None  # the round the group runs next should the coordinator be down
    backlog: bool = False  # rounds the group decided without the coordinator, not yet reported
    behind: bool = False  # the coordinator contradicted this peer's group: resync first
    held_round: int = 0  # the committed round this peer's trainer holds
    peer_id: str = ""


def next_event(view: View) -> Event:
    """The one event this pass runs, in precedence order (the daemon's loop is a loop over this)."""
    if view.rejected:
        return Event.REJECTED
    if view.carrying:
        return Event.CARRIED
    info = view.info
    if info is None:
        return Event.GROUP_GOES_ON if not view.final_known and view.offline_next is not None else Event.COORDINATOR_DOWN
    if view.backlog:
        return Event.BACKLOG
    if view.behind or info.last_committed_round > view.held_round:
        return Event.BEHIND
    if info.finished:
        return Event.FINISHED
    if info.open_round and view.peer_id in info.participants and info.round == info.open_round:
        return Event.PLANNED
    return Event.UNPLANNED
