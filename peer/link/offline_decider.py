"""Deciding a round from the group's DHT votes while the coordinator is unreachable, and the backlog of rounds so
decided, to report once it is back (``peer.link.backlog``)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from peer.link.retry import clause
from swarm.net.group_decided import GroupDecided
from swarm.train.round import Decision, Outcome, RoundResult, Vote
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


def next_offline_round(decided: RoundResult, max_rounds: Optional[int]) -> Optional[int]:
    """The round the group goes on with, from the state this peer holds, should the coordinator be unreachable for
    it after ``decided``: None when this peer holds no decided state (it is behind), or after the run's last round."""
    holds = decided.outcome in (Outcome.COMMITTED, Outcome.VOIDED)
    more = max_rounds is None or decided.round_no < max_rounds
    return decided.round_no + 1 if holds and more else None


@dataclass(frozen=True)
class Backlogged:
    """A round the group decided without the coordinator, to report once it is back."""

    request: pb.ReportRoundRequest
    committed_hash: Optional[str]


class OfflineDecider:
    """Threads: ``decide`` runs on the round runner's executor, which appends to the backlog; the main thread
    reads it and takes it (``take``). ``coordinator_decided`` is set by join (main thread) and by a decision the
    coordinator made (executor). Both under ``_lock``. ``group_decision`` is set once by the main thread before
    the first round runs, then only called."""

    def __init__(self, *, tag: Callable[[Optional[int]], str]) -> None:
        self.tag = tag
        self.group_decision: Callable[[Vote], Optional[GroupDecided]] = lambda vote: None
        self._lock = threading.Lock()
        self._backlog: list[Backlogged] = []
        self._coordinator_decided = False  # see ``CoordinatorLink.join``

    @property
    def backlog(self) -> list[Backlogged]:
        """The rounds decided without the coordinator, oldest first (the list itself: taken whole by ``take``)."""
        with self._lock:
            return self._backlog

    def take(self) -> list[Backlogged]:
        with self._lock:
            backlog, self._backlog = self._backlog, []
            return backlog

    def pending(self) -> list[Backlogged]:
        """A copy of the backlog, to report without taking it."""
        with self._lock:
            return list(self._backlog)

    @property
    def coordinator_decided(self) -> bool:
        with self._lock:
            return self._coordinator_decided

    @coordinator_decided.setter
    def coordinator_decided(self, decided: bool) -> None:
        with self._lock:
            self._coordinator_decided = decided

    def decide(
        self, vote: Vote, request: pb.ReportRoundRequest, error: Exception, last_group: Optional[set[str]]
    ) -> Optional[Decision]:
        """The group's decision of ``vote``'s round from its DHT votes, added to the backlog with them; None when
        this peer must wait for the coordinator (``error``: why it did not answer)."""
        if not self.coordinator_decided:
            # a restarted process that has not yet taken part in a round the coordinator decided does not know where
            # its group is: restarted while the coordinator was behind the group (it had not heard the group's rounds
            # yet), it was planned into a round the group had played long ago (a chaos soak saw three restarted
            # processes decide two such rounds among themselves and resync)
            logger.warning(
                "%s %s; this restarted process has not yet taken part in a round the coordinator decided: "
                "waiting for the coordinator",
                self.tag(vote.round_no),
                clause(error),
            )
            return None
        if request.group_digest:  # a group too large to name carries no votes: only the coordinator decides it
            logger.warning(
                "%s %s; a group of %d members is decided by the coordinator only: waiting for it",
                self.tag(vote.round_no),
                clause(error),
                request.group_size,
            )
            return None
        if len(vote.group) <= 1 and len(last_group or ()) > 1:
            # alone where others were planned: its groupmates are in another round (a process restarted into the
            # round the coordinator last had open, while they went on without it), so a decision of its own would
            # only split it off from them (a chaos soak saw one go on alone for six rounds, then resync)
            logger.warning(
                "%s %s; this peer averaged alone where %d peers were planned: waiting for the coordinator",
                self.tag(vote.round_no),
                clause(error),
                len(last_group),
            )
            return None
        decided = self.group_decision(vote)
        if decided is None:
            if vote.group:
                logger.warning(
                    "%s %s; not every groupmate's vote arrived, waiting for the coordinator",
                    self.tag(vote.round_no),
                    clause(error),
                )
            return None
        committed = decided.committed_hash
        # the votes go with the report: a member whose process dies before it can report still counts
        request.group_votes.extend(decided.votes)
        with self._lock:
            self._backlog.append(Backlogged(request, committed))
        logger.warning(
            "%s coordinator unreachable; round decided by the group's votes: %s",
            self.tag(vote.round_no),
            f"committed {committed}" if committed else "voided",
        )
        return Decision(vote.round_no, committed, by_group=True, holders=decided.holders)
