"""The peer's side of the coordinator: round plans, reports, decisions — and what the group decides
on its own while the coordinator is unreachable (the backlog it reports once the coordinator is back).
The round runner's Decider.

``CoordinatorLink`` is the facade the daemon and the round runner use, composed of four parts: the retried calls
(``peer.link.coordinator_calls``), the plan cache (``peer.link.round_plans``), the report-and-wait decision of a round
(``peer.link.round_decider``) and the offline decider with its backlog (``peer.link.offline_decider``)."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.link.coordinator_calls import Behind, CoordinatorCalls, Departed, PeerExit
from peer.link.offline_decider import Backlogged, GroupDecided, OfflineDecider
from peer.link.retry import with_retry
from peer.link.round_decider import RoundDecider
from peer.link.round_plans import RoundPlans
from swarm.control.client import CoordinatorClient, CoordinatorUnreachable
from swarm.control.signing import Libp2pSigner
from swarm.core.trust.credential import Member, PeerKey
from swarm.core.wire_protocol import ASK_THE_OPERATOR, PROTOCOL, mismatch, release
from swarm.train.round import Decision, Vote
from swarm.v1 import coordinator_pb2 as pb

__all__ = ["Backlogged", "Behind", "CoordinatorLink", "Departed", "GroupDecided", "PeerExit"]

logger = logging.getLogger(__name__)

STOP_DECISION_WAIT_S = 3.0  # a peer asked to leave waits at most this long for the decision of a round it reported


class CoordinatorLink:
    """Threads: ``decide`` runs on the round runner's executor, as do the exchange's ``planned`` and
    ``current_processes``; ``renew`` on the heartbeat thread; everything else on the main thread (``round_choice``:
    the round runner's, as it makes a round's plan). The fields
    both threads touch live in the plan cache and the offline decider, under their locks. ``peer_id``,
    ``min_peers`` and ``member`` are set by ``join`` on the main thread before any other thread starts, and
    ``param_count`` once before the first round; the heartbeat thread renews ``member.credential`` (one attribute
    store)."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        stop: threading.Event,
        faults: FaultPlan,
        poll_s: float,
        leave_grace_s: float,
        tag: Callable[[Optional[int]], str],
        give_up_after_s: Optional[float] = None,
    ) -> None:
        self.stop, self.faults = stop, faults
        self.own_poll_s, self.tag = poll_s, tag
        self.leave_grace_s = min(leave_grace_s, STOP_DECISION_WAIT_S)  # SIGTERM stops a peer within seconds
        self.plans = RoundPlans(tag=tag)
        self.offline = OfflineDecider(tag=tag)
        self.calls = CoordinatorCalls(
            client, stop=stop, tag=tag, finished=lambda: self.plans.final is not None, give_up_after_s=give_up_after_s
        )
        self.decider = RoundDecider(
            calls=self.calls,
            plans=self.plans,
            offline=self.offline,
            get_round=self.get_round,
            faults=faults,
            stop=stop,
            tag=tag,
            poll_s=lambda: self.poll_s,
            leave_grace_s=self.leave_grace_s,
            peer_id=lambda: self.peer_id,
            param_count=lambda: self.param_count,
        )
        self.peer_id = ""
        self.member: Optional[Member] = None  # after join: this peer's key and credential (renewed by heartbeats)
        self.param_count = 0  # of this peer's model, carried by every report

    # ---- the parts' fields, as the daemon and the tests name them -------------------------------------
    @property
    def client(self) -> CoordinatorClient:
        return self.calls.client

    @client.setter
    def client(self, client: CoordinatorClient) -> None:
        self.calls.client = client

    @property
    def give_up_after_s(self) -> Optional[float]:
        return self.calls.give_up_after_s

    @property
    def final(self) -> Optional[tuple[int, str]]:
        """(round, hash) once the coordinator said the run finished."""
        return self.plans.final

    @property
    def live_peers(self) -> int:
        return self.plans.live_peers

    @property
    def plan_open(self) -> bool:
        """The last planned() answer was the coordinator's plan of the open round."""
        return self.plans.plan_open

    @property
    def last_group(self) -> Optional[set[str]]:
        return self.plans.last_group

    @last_group.setter
    def last_group(self, group: Optional[set[str]]) -> None:
        self.plans.last_group = group

    @property
    def min_peers(self) -> int:
        return self.plans.min_peers

    @property
    def backlog(self) -> list[Backlogged]:
        return self.offline.backlog

    @property
    def group_decision(self) -> Callable[[Vote], Optional[GroupDecided]]:
        return self.offline.group_decision

    @group_decision.setter
    def group_decision(self, decide: Callable[[Vote], Optional[GroupDecided]]) -> None:
        self.offline.group_decision = decide

    @property
    def coordinator_decided(self) -> bool:
        """See ``join``."""
        return self.offline.coordinator_decided

    @coordinator_decided.setter
    def coordinator_decided(self, decided: bool) -> None:
        self.offline.coordinator_decided = decided

    # ---- joining and leaving -------------------------------------------------------------------------
    def join(self, options, *, key: PeerKey, libp2p: Libp2pSigner) -> pb.JoinResponse:
        """Join the run, retrying while the coordinator is unreachable; gives up after join_timeout_s.
        Sets ``peer_id`` and ``member``."""
        joined = with_retry(
            lambda: self.client.join(
                key=key,
                libp2p=libp2p,
                site=options.site,
                device=options.device,
                name=options.name or socket.gethostname(),
            ),
            what="join",
            stop=self.stop,
            give_up_after_s=options.join_timeout_s,
        )
        if joined is None and self.stop.is_set():
            raise PeerExit(0)  # stopped while the coordinator did not answer: nothing to leave yet
        if joined is None:
            logger.error(
                "could not reach the coordinator at %s for %.0fs; check the join string's address "
                "and that the coordinator is running",
                options.join.address,
                options.join_timeout_s,
            )
            raise PeerExit(2)
        self.peer_id = joined.peer_id
        try:
            self.plans.min_peers = int(json.loads(joined.run_spec_json)["rounds"]["min_peers"])
        except (ValueError, KeyError, TypeError):  # an older coordinator's spec: nothing to say while waiting
            self.plans.min_peers = 1
        if joined.protocol != PROTOCOL:  # an older coordinator admits any peer; this one could not average
            logger.error(
                "%s %s",
                self.tag(None),
                mismatch(PROTOCOL, joined.protocol, peer_version=release(), fix=ASK_THE_OPERATOR),
            )
            self.leave(None, reason="another wire protocol")
            raise PeerExit(2)
        # a first process may decide by its group's votes at once; a restarted one only once it took part in a round
        # the coordinator decided: until then it does not know where its group is (``decide_by_group``)
        self.coordinator_decided = joined.session <= 1
        self.member = Member(
            key=key,
            credential=joined.credential,
            coordinator_public_key=joined.coordinator_public_key,
            run_id=joined.run_id,
        )
        return joined

    def renew(self, credential: bytes) -> None:
        """A heartbeat brought a fresh credential (heartbeat thread; one attribute store, atomic)."""
        if credential and self.member is not None:
            self.member.credential = credential

    def leave(self, last_heartbeat: Optional[pb.HeartbeatRequest], reason: str = "peer exiting") -> None:
        """A last heartbeat carries the final numbers (if any), then the peer leaves; best effort both (the
        lease expires anyway)."""
        self.calls.leave(self.peer_id, last_heartbeat, reason)

    # ---- round plans ---------------------------------------------------------------------------------
    def get_round(self, round_no: int) -> pb.RoundInfo:
        """Round ``round_no`` (0: the current one), asked once; raises CoordinatorUnreachable."""
        info = self.client.get_round(peer_id=self.peer_id, round_no=round_no)
        self.plans.remember(info, round_no)
        return info

    @property
    def paced_poll_s(self) -> float:
        return self.plans.paced_poll_s

    @property
    def poll_s(self) -> float:
        """How long a waiting peer waits between polls: its own interval, or the coordinator's pace if longer."""
        return max(self.own_poll_s, self.plans.paced_poll_s)

    def heard(self, info: pb.RoundInfo) -> None:
        """A RoundInfo from the coordinator (a call, or a heartbeat's answer): remember whether the run finished,
        and how often the coordinator lets a waiting peer poll it."""
        self.plans.heard(info)

    def round_choice(self, round_no: int) -> Optional[pb.RoundChoice]:
        """The controller's choice for ``round_no``, which the round runner makes the round's plan from
        (``swarm.train.round_plan.plan_round``); None: the coordinator is unreachable and never said, and the group
        then runs a round it did not open by the run's config."""
        if not self.plans.knows_choice(round_no):
            try:
                self.get_round(round_no)
            except CoordinatorUnreachable:
                return None
        return self.plans.choice(round_no)

    def budget(self, round_no: int, full: tuple[int, int]) -> tuple[int, int]:
        """(steps before a carried merge, steps) for ``round_no``: the coordinator's time budget for this peer
        (``RoundPlans.budget``); ``full`` when the round has no budget for it (not opened yet, or the coordinator is
        unreachable)."""
        plan = self.plans.plan(round_no)
        if plan is None:
            try:
                plan = self.get_round(round_no).plan
            except CoordinatorUnreachable:
                return full
        return self.plans.budget(round_no, plan, self.peer_id, full)

    def left_out(self, round_no: int, step_time_s: float = math.nan) -> bool:
        """Asked once the round's steps are done: the coordinator went on with ``round_no`` without this peer (it was
        not ready by the deadline: too slow); False when the coordinator is unreachable (the group decides then)."""
        try:
            out = self.peer_id in self.get_round(round_no).plan.left_out
        except CoordinatorUnreachable:
            return False
        if out:
            self._went_on_without(round_no, step_time_s, "resyncing")
        return out

    def passed_over(self, round_no: int, heard: Optional[pb.RoundInfo], step_time_s: float = math.nan) -> bool:
        """Asked between parts of ``round_no``'s inner steps, with the round the heartbeat last heard of (no call
        here): the coordinator committed ``round_no`` without this peer, or left it out of it (not ready by the
        deadline: too slow), so the rest of its steps would be lost. False on what was not heard yet."""
        if self.stop.is_set():
            return True  # leaving: the rest of the round's steps would not be sent (no log: the signal said it)
        if heard is None:
            return False
        out = heard.last_committed_round >= round_no or (
            heard.round == round_no and self.peer_id in heard.plan.left_out
        )
        if out:
            self._went_on_without(round_no, step_time_s, "it stops training that round and resyncs")
        return out

    def _went_on_without(self, round_no: int, step_time_s: float, then: str) -> None:
        logger.warning(
            "%s round %d went on without this peer (too slow: %.3g s per step); %s",
            self.tag(round_no),
            round_no,
            step_time_s,
            then,
        )

    def round_info(self, round_no: int) -> pb.RoundInfo:
        """Round ``round_no``, retrying while the coordinator is unreachable (``call``: bounded)."""
        return self.call(lambda: self.get_round(round_no), "get round")

    def holders(self, round_no: int) -> list[str]:
        """Who holds round ``round_no``'s state, as the coordinator says (retrying as ``call`` does)."""
        return list(self.round_info(round_no).holders)

    def planned(self, round_no: int) -> Optional[set[str]]:
        """Who the coordinator planned into ``round_no``; while it is down (or behind), the last group."""
        self.plans.asking()
        try:
            info: Optional[pb.RoundInfo] = self.get_round(round_no)
        except Exception:
            info = None
        return self.plans.planned(round_no, info)

    def current_processes(self) -> dict[str, str]:
        """Peer id -> the libp2p id of its current process, as of the last ``planned`` answer ({}: unknown)."""
        return self.plans.processes()

    def still_planned(self, round_no: int) -> bool:
        info = self.round_info(round_no)
        return info.outcome == pb.ROUND_OUTCOME_OPEN and self.peer_id in info.participants

    # ---- decisions (``peer.link.round_decider``) ----------------------------------------------------------
    def decide(self, vote: Vote) -> Decision:
        """Report ``vote`` and wait for the decision; should the coordinator be unreachable, the group's
        DHT votes decide when all are in (the round then joins the backlog)."""
        return self.decider.decide(vote)

    def report_backlog_first(self) -> None:
        """Let the coordinator hear the rounds the group decided without it (``RoundDecider.report_backlog_first``)."""
        self.decider.report_backlog_first()

    def decide_by_group(self, vote: Vote, request: pb.ReportRoundRequest, error: Exception) -> Optional[Decision]:
        """The group's decision from its DHT votes (``OfflineDecider.decide``); None: wait for the coordinator."""
        return self.decider.decide_by_group(vote, request, error)

    def await_decision(self, round_no: int, fallback=None):
        """The coordinator's RoundInfo once it decided ``round_no`` (``RoundDecider.await_decision``)."""
        return self.decider.await_decision(round_no, fallback)

    def report_request(self, vote: Vote) -> pb.ReportRoundRequest:
        return self.decider.report_request(vote)

    def serve_final_state(self, serve_s: float, *, ready: Callable[[], None]) -> None:
        """After the run: stay a holder of the final state while live peers still hold an older one (a
        joiner, a restarted peer) — without a holder they would end without a final model. Bounded by
        ``serve_s`` and by the coordinator going away (it says who is behind)."""
        deadline = time.monotonic() + serve_s
        announced = False
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                info = self.get_round(0)
            except CoordinatorUnreachable:
                return
            if info.behind_peers <= 0:
                return
            if not announced:
                logger.info("%s serving the final state to %d peers still behind", self.tag(None), info.behind_peers)
                announced = True
            ready()
            self.stop.wait(self.poll_s)

    def take_backlog(self) -> list[Backlogged]:
        return self.offline.take()

    def call(self, fn, what: str):
        """``fn()``, retrying while the coordinator is unreachable (``CoordinatorCalls.call``)."""
        return self.calls.call(fn, what)
