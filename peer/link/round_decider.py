"""Deciding a round the peer played: report its vote to the coordinator and wait for the coordinator's decision;
while the coordinator is unreachable (or back but behind the group), the group's DHT votes decide
(``peer.link.offline_decider``). The round runner's Decider, behind ``CoordinatorLink.decide``."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.link.coordinator_calls import Behind, CoordinatorCalls, PeerExit
from peer.link.offline_decider import OfflineDecider
from peer.link.round_plans import RoundPlans
from swarm.control.client import CoordinatorUnreachable
from swarm.core.trust import commit_rule
from swarm.core.trust.round_vote import group_id
from swarm.train.round import Decision, Vote
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

MAX_REPORTED_ERROR_BYTES = 1024  # the coordinator refuses a round report whose error is longer

DECIDED = (pb.ROUND_OUTCOME_COMMITTED, pb.ROUND_OUTCOME_VOIDED)
FALLBACK_AFTER_S = 2.0  # unreachable this long while awaiting a decision: the group's votes decide


class RoundDecider:
    """Threads: ``decide`` runs on the round runner's executor; ``await_decision`` there and on the main thread (the
    backlog's report). It keeps no mutable state of its own: what it learns goes to the plan cache (through
    ``get_round``) and to the offline decider, both locked; ``peer_id`` and ``param_count`` are asked of the link
    (set before the first round)."""

    def __init__(
        self,
        *,
        calls: CoordinatorCalls,
        plans: RoundPlans,
        offline: OfflineDecider,
        get_round: Callable[[int], pb.RoundInfo],
        faults: FaultPlan,
        stop: threading.Event,
        tag: Callable[[Optional[int]], str],
        poll_s: Callable[[], float],
        leave_grace_s: float,
        peer_id: Callable[[], str],
        param_count: Callable[[], int],
    ) -> None:
        self.calls, self.plans, self.offline, self.get_round = calls, plans, offline, get_round
        self.faults, self.stop, self.tag, self.poll_s = faults, stop, tag, poll_s
        self.leave_grace_s, self.peer_id, self.param_count = leave_grace_s, peer_id, param_count

    def decide(self, vote: Vote) -> Decision:
        """Report ``vote`` and wait for the decision; should the coordinator be unreachable, the group's
        DHT votes decide when all are in (the round then joins the backlog)."""
        round_no = vote.round_no
        request = self.report_request(vote)
        if self.faults.drops(round_no, "report"):
            self.faults.at(round_no, "reported")
            return self._decision(round_no, self.await_decision(round_no))
        try:
            self._counted(self.calls.client.report_round(request), round_no)
        except CoordinatorUnreachable as e:
            if not (isinstance(e, Behind) and self.offline.backlog and self._caught_up(request)):
                decision = self.decide_by_group(vote, request, e)
                if decision is not None:
                    return decision
                self.report_backlog_first()
                self.calls.call(lambda: self.calls.client.report_round(request), f"report round {round_no}")
        self.faults.at(round_no, "reported")
        fallback = lambda error: self.decide_by_group(vote, request, error)  # noqa: E731
        info = self.await_decision(round_no, fallback=fallback)
        if isinstance(info, Decision):
            return info
        self.offline.coordinator_decided = True
        return self._decision(round_no, info)

    @staticmethod
    def _counted(response: pb.ReportRoundResponse, round_no: int) -> None:
        """Behind when the coordinator is back but at an earlier round than this report's: it did not count it."""
        if 0 < response.round.open_round < round_no:
            raise Behind(f"the coordinator is at round {response.round.open_round}")

    def _caught_up(self, request: pb.ReportRoundRequest) -> bool:
        """Whether the coordinator, told the rounds the group decided without it, now counts this report. It catches
        up from them, so a peer holding them reports them at once, before the group's votes: a chaos soak lost 8 s of
        every peer to those votes when a groupmate had died before voting. False when it is still behind (e.g. it
        voided the last of them): the votes decide after all."""
        self.report_backlog_first()
        try:
            self._counted(
                self.calls.call(lambda: self.calls.client.report_round(request), f"report round {request.round}"),
                request.round,
            )
        except Behind:
            return False
        return True

    def report_backlog_first(self) -> None:
        """Before waiting for the coordinator's decision on this round, let it hear the rounds the group decided
        without it: back but behind the group, it cannot reach this round until it has decided those, and a
        member waiting here would otherwise hold them back until the coordinator gave up on the group's
        reports (a chaos soak saw it commit a lone restarted peer's round instead, and the group resync).
        The entries stay in the backlog: ``peer.link.backlog`` reports them again (a late report is ignored) and
        checks every decision against the group's."""
        for entry in self.offline.pending():
            number = entry.request.round
            self.calls.call(lambda: self.calls.client.report_round(entry.request), f"report round {number}")  # noqa: B023
            self.await_decision(number)

    def decide_by_group(self, vote: Vote, request: pb.ReportRoundRequest, error: Exception) -> Optional[Decision]:
        """The group's decision from its DHT votes (``OfflineDecider.decide``); None: wait for the coordinator."""
        return self.offline.decide(vote, request, error, self.plans.last_group)

    def await_decision(self, round_no: int, fallback=None):
        """The coordinator's RoundInfo once it decided ``round_no`` (or ``fallback``'s Decision, tried once
        when it stays unreachable). A peer asked to leave still waits up to leave_grace_s, so that it
        leaves holding the committed state."""
        leave_by: Optional[float] = None
        unreachable_since: Optional[float] = None
        while True:
            if self.stop.is_set():
                leave_by = leave_by or time.monotonic() + self.leave_grace_s
                if time.monotonic() > leave_by:
                    raise PeerExit(0)
            try:
                info = self.get_round(round_no)
                unreachable_since = None
            except CoordinatorUnreachable as e:
                logger.warning("%s waiting for the decision: %s", self.tag(round_no), e)
                info = None
                unreachable_since = unreachable_since or time.monotonic()
                if fallback is not None and time.monotonic() - unreachable_since > FALLBACK_AFTER_S:
                    decision, fallback = fallback(e), None
                    if decision is not None:
                        return decision
                self.calls.give_up_if_gone(
                    time.monotonic() - unreachable_since, f"waiting for the decision of round {round_no}"
                )
            if info is not None and info.outcome in DECIDED:
                return info
            time.sleep(self.poll_s() if info is not None else 1.0)  # polled: there is no push

    def report_request(self, vote: Vote) -> pb.ReportRoundRequest:
        averaged = vote.averaged
        # a group too large to name goes as its digest and size (swarm.core.trust.commit_rule)
        named = len(vote.group) <= commit_rule.NAMED_GROUP_MAX
        return pb.ReportRoundRequest(
            peer_id=self.peer_id(),
            round=vote.round_no,
            ok=vote.ok,
            state_hash=vote.state_hash,
            group=vote.group if named else [],
            group_digest="" if named else group_id(list(vote.group)),
            group_size=0 if named else len(vote.group),
            samples=vote.contribution.samples,
            inner_steps=vote.train.steps,
            inner_time_s=vote.train.inner_time_s,
            exchange_time_s=averaged.seconds if averaged else 0.0,
            bytes_sent=averaged.bytes_sent if averaged else 0,
            bytes_received=averaged.bytes_received if averaged else 0,
            loss=vote.train.mean_loss,
            error=vote.error.encode()[:MAX_REPORTED_ERROR_BYTES].decode(errors="ignore"),
            param_count=self.param_count(),
            upload_mbit_s=averaged.upload_mbit_s if averaged else math.nan,
            download_mbit_s=averaged.download_mbit_s if averaged else math.nan,
            rtt_ms=averaged.rtt_ms if averaged else math.nan,
        )

    @staticmethod
    def _decision(round_no: int, info: pb.RoundInfo) -> Decision:
        committed = info.committed_hash if info.outcome == pb.ROUND_OUTCOME_COMMITTED else None
        return Decision(round_no, committed, finished=info.finished, holders=list(info.holders))
