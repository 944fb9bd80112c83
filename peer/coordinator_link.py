"""The peer's side of the coordinator: round plans, reports, decisions — and what the group decides
on its own while the coordinator is unreachable (the backlog it reports once the coordinator is back).
The round runner's Decider."""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.retry import clause, with_retry
from swarm.control.client import CoordinatorClient, CoordinatorUnreachable
from swarm.control.signing import Libp2pSigner
from swarm.core.credential import Member, PeerKey
from swarm.core.fragments import round_steps
from swarm.core.wire_protocol import ASK_THE_OPERATOR, PROTOCOL, mismatch, release
from swarm.train.round import Decision, Vote
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

MAX_REPORTED_ERROR_BYTES = 1024  # the coordinator refuses a round report whose error is longer

DECIDED = (pb.ROUND_OUTCOME_COMMITTED, pb.ROUND_OUTCOME_VOIDED)
MAX_CHOICES_KEPT = 8  # rounds whose controller choice is remembered
FALLBACK_AFTER_S = 2.0  # unreachable this long while awaiting a decision: the group's votes decide
STOP_DECISION_WAIT_S = 3.0  # a peer asked to leave waits at most this long for the decision of a round it reported
MAX_PACED_POLL_S = 60.0  # a paced poll interval beyond this (a coordinator's mistake) is taken as this
FINISHED_RETRY_S = 5.0  # once the coordinator said the run finished, how long an unanswered call is retried


class PeerExit(Exception):
    """Stop the daemon with this exit code; the message has already been logged."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


@dataclass(frozen=True)
class GroupDecided:
    """A round decided by the group's DHT votes (the coordinator's commit rule on a complete set)."""

    committed_hash: Optional[str]  # None: void
    holders: list[str]  # the DHT ids of the members that hold the committed state
    votes: list[pb.SignedVote]  # every member's vote as it signed it, for the coordinator to count


@dataclass(frozen=True)
class Backlogged:
    """A round the group decided without the coordinator, to report once it is back."""

    request: pb.ReportRoundRequest
    committed_hash: Optional[str]


class Departed(Exception):
    """The coordinator said the run finished and has stopped answering since: nothing more will come from it."""


class Behind(CoordinatorUnreachable):
    """The coordinator answered from an earlier round than the one reported: back, not yet caught up with the group."""


class CoordinatorLink:
    """Threads: ``decide`` runs on the round runner's executor; everything else on the main thread.
    ``backlog`` is appended by the executor and taken by the main thread (list append/swap are atomic);
    ``last_group``, ``live_peers`` and ``plans`` are plain values either thread may refresh (``plans`` is
    replaced whole, never changed in place)."""

    def __init__(self, client: CoordinatorClient, *, stop: threading.Event, faults: FaultPlan, poll_s: float,
                 leave_grace_s: float, tag: Callable[[Optional[int]], str],
                 give_up_after_s: Optional[float] = None) -> None:
        self.client, self.stop, self.faults = client, stop, faults
        self.own_poll_s, self.tag = poll_s, tag
        self.paced_poll_s = 0.0  # the coordinator's least time between polls (its pace; 0: none), either thread
        self.leave_grace_s = min(leave_grace_s, STOP_DECISION_WAIT_S)  # SIGTERM stops a peer within seconds
        # unreachable this long while this peer has nothing it can do without the coordinator: it exits (None: never)
        self.give_up_after_s = give_up_after_s
        self.final: Optional[tuple[int, str]] = None  # (round, hash) once the coordinator said the run finished
        self.peer_id = ""
        self.member: Optional[Member] = None  # after join: this peer's key and credential (renewed by heartbeats)
        self.backlog: list[Backlogged] = []
        self.last_group: Optional[set[str]] = None
        self.plan_open = False  # the last planned() answer was the coordinator's plan of the open round
        self.processes: dict[str, str] = {}  # the open round's participants' libp2p ids (current_processes)
        self.live_peers = 0
        self.group_decision: Callable[[Vote], Optional[GroupDecided]] = lambda vote: None
        self.param_count = 0  # of this peer's model, carried by every report
        self._choices: dict[int, pb.RoundChoice] = {}  # round -> the controller's choice, as the coordinator said
        self.plans: dict[int, pb.RoundPlan] = {}  # the time budgets of the latest rounds seen, by round
        self.coordinator_decided = False  # see ``join``
        self.min_peers = 1  # the run's [rounds] min_peers (from the spec at join)
        self._waiting_said: Optional[tuple[int, int]] = None  # (round, peers missing) last said while waiting

    def join(self, options, *, key: PeerKey, libp2p: Libp2pSigner) -> pb.JoinResponse:
        """Join the run, retrying while the coordinator is unreachable; gives up after join_timeout_s.
        Sets ``peer_id`` and ``member``."""
        joined = with_retry(
            lambda: self.client.join(key=key, libp2p=libp2p, site=options.site, device=options.device,
                                     name=options.name or socket.gethostname()),
            what="join", stop=self.stop, give_up_after_s=options.join_timeout_s,
        )
        if joined is None and self.stop.is_set():
            raise PeerExit(0)  # stopped while the coordinator did not answer: nothing to leave yet
        if joined is None:
            logger.error("could not reach the coordinator at %s for %.0fs; check the join string's address "
                         "and that the coordinator is running", options.join.address, options.join_timeout_s)
            raise PeerExit(2)
        self.peer_id = joined.peer_id
        try:
            self.min_peers = int(json.loads(joined.run_spec_json)["rounds"]["min_peers"])
        except (ValueError, KeyError, TypeError):  # an older coordinator's spec: nothing to say while waiting
            self.min_peers = 1
        if joined.protocol != PROTOCOL:  # an older coordinator admits any peer; this one could not average
            logger.error("%s %s", self.tag(None), mismatch(PROTOCOL, joined.protocol, peer_version=release(),
                                                         fix=ASK_THE_OPERATOR))
            self.leave(None, reason="another wire protocol")
            raise PeerExit(2)
        # a first process may decide by its group's votes at once; a restarted one only once it took part in a round
        # the coordinator decided: until then it does not know where its group is (``decide_by_group``)
        self.coordinator_decided = joined.session <= 1
        self.member = Member(key=key, credential=joined.credential,
                             coordinator_public_key=joined.coordinator_public_key, run_id=joined.run_id)
        return joined

    def renew(self, credential: bytes) -> None:
        """A heartbeat brought a fresh credential (heartbeat thread; one attribute store, atomic)."""
        if credential and self.member is not None:
            self.member.credential = credential

    # ---- round plans ---------------------------------------------------------------------------------
    def get_round(self, round_no: int) -> pb.RoundInfo:
        """Round ``round_no`` (0: the current one), asked once; raises CoordinatorUnreachable."""
        info = self.client.get_round(peer_id=self.peer_id, round_no=round_no)
        self.live_peers = info.live_peers
        self.heard(info)
        if round_no == 0:
            self._say_if_waiting_for_peers(info)
        if info.HasField("choice") and info.round not in self._choices:
            self._choices[info.round] = info.choice  # a round's choice never changes: the first answer holds
            for old in sorted(self._choices)[:-MAX_CHOICES_KEPT]:
                del self._choices[old]
        if info.HasField("plan"):
            kept = {r: plan for r, plan in self.plans.items() if r >= info.round - 2}
            self.plans = {**kept, info.round: info.plan}
        return info

    def _say_if_waiting_for_peers(self, info: pb.RoundInfo) -> None:
        """No round is open and the run has fewer peers than ``min_peers``: say so once per round and shortfall
        (a lone first peer otherwise waits in silence)."""
        missing = self.min_peers - info.live_peers
        if info.open_round or info.finished or missing <= 0:
            return
        next_round = max(info.round, info.last_committed_round) + 1
        if self._waiting_said != (next_round, missing):
            self._waiting_said = (next_round, missing)
            logger.info("%s waiting for %d more peer%s (min_peers = %d) before round %d opens", self.tag(None), missing,
                        "" if missing == 1 else "s", self.min_peers, next_round)

    @property
    def poll_s(self) -> float:
        """How long a waiting peer waits between polls: its own interval, or the coordinator's pace if longer."""
        return max(self.own_poll_s, self.paced_poll_s)

    def heard(self, info: pb.RoundInfo) -> None:
        """A RoundInfo from the coordinator (a call, or a heartbeat's answer): remember whether the run finished,
        and how often the coordinator lets a waiting peer poll it."""
        self.paced_poll_s = min(MAX_PACED_POLL_S, max(0.0, info.poll_interval_s))
        if info.finished and info.last_committed_round > 0:
            self.final = (info.last_committed_round, info.last_committed_hash)

    def round_choice(self, round_no: int) -> Optional[pb.RoundChoice]:
        """The controller's choice for ``round_no`` (None: the controller is off, or the coordinator is
        unreachable and never said: the group then runs a round it did not open, with the run's codec)."""
        if round_no not in self._choices:
            try:
                self.get_round(round_no)
            except CoordinatorUnreachable:
                return None
        return self._choices.get(round_no)

    def budget(self, round_no: int, full: tuple[int, int]) -> tuple[int, int]:
        """(steps before a carried merge, steps) for ``round_no``: the coordinator's time budget for this
        peer, capped at what a full-speed peer does in the round (``full``: at the run's H; with the
        controller on, at the H it chose for the round), the split staying ``full[0]`` (τ); ``full`` when the
        round has no budget for it (not opened yet, or the coordinator is unreachable)."""
        plan = self.plans.get(round_no)
        if plan is None:
            try:
                plan = self.get_round(round_no).plan
            except CoordinatorUnreachable:
                return full
        mine = next((p.inner_steps for p in plan.peers if p.peer_id == self.peer_id), 0)
        if mine <= 0:
            return full
        choice = self._choices.get(round_no)
        longest = round_steps(round_no, choice.inner_steps, choice.fragments) if choice and choice.fragments > 0 else 0
        steps = min(max(full[1], longest), mine)
        return min(full[0], steps), steps

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
        out = heard.last_committed_round >= round_no or (heard.round == round_no and self.peer_id in heard.plan.left_out)
        if out:
            self._went_on_without(round_no, step_time_s, "it stops training that round and resyncs")
        return out

    def _went_on_without(self, round_no: int, step_time_s: float, then: str) -> None:
        logger.warning("%s round %d went on without this peer (too slow: %.3g s per step); %s", self.tag(round_no),
                       round_no, step_time_s, then)

    def round_info(self, round_no: int) -> pb.RoundInfo:
        """Round ``round_no``, retrying while the coordinator is unreachable (``call``: bounded)."""
        return self.call(lambda: self.get_round(round_no), "get round")

    def holders(self, round_no: int) -> list[str]:
        """Who holds round ``round_no``'s state, as the coordinator says (retrying as ``call`` does)."""
        return list(self.round_info(round_no).holders)

    def planned(self, round_no: int) -> Optional[set[str]]:
        """Who the coordinator planned into ``round_no``; while it is down (or behind), the last group."""
        self.processes, self.plan_open = {}, False  # unknown unless this answer says
        try:
            info = self.get_round(round_no)
        except Exception:
            return self.last_group
        if info.round != round_no or info.outcome != pb.ROUND_OUTCOME_OPEN:
            return self.last_group
        self.last_group, self.plan_open = set(info.participants), True
        if len(info.participant_dht_ids) == len(info.participants):
            self.processes = dict(zip(info.participants, info.participant_dht_ids))
        return self.last_group

    def current_processes(self) -> dict[str, str]:
        """Peer id -> the libp2p id of its current process, as of the last ``planned`` answer ({}: unknown)."""
        return self.processes

    def still_planned(self, round_no: int) -> bool:
        info = self.round_info(round_no)
        return info.outcome == pb.ROUND_OUTCOME_OPEN and self.peer_id in info.participants

    # ---- decisions -----------------------------------------------------------------------------------
    def decide(self, vote: Vote) -> Decision:
        """Report ``vote`` and wait for the decision; should the coordinator be unreachable, the group's
        DHT votes decide when all are in (the round then joins the backlog)."""
        round_no = vote.round_no
        request = self.report_request(vote)
        if self.faults.drops(round_no, "report"):
            self.faults.at(round_no, "reported")
            return self._decision(round_no, self.await_decision(round_no))
        try:
            self._counted(self.client.report_round(request), round_no)
        except CoordinatorUnreachable as e:
            if not (isinstance(e, Behind) and self.backlog and self._caught_up(request)):
                decision = self.decide_by_group(vote, request, e)
                if decision is not None:
                    return decision
                self.report_backlog_first()
                self.call(lambda: self.client.report_round(request), f"report round {round_no}")
        self.faults.at(round_no, "reported")
        fallback = lambda error: self.decide_by_group(vote, request, error)  # noqa: E731
        info = self.await_decision(round_no, fallback=fallback)
        if isinstance(info, Decision):
            return info
        self.coordinator_decided = True
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
            self._counted(self.call(lambda: self.client.report_round(request), f"report round {request.round}"),
                          request.round)
        except Behind:
            return False
        return True

    def report_backlog_first(self) -> None:
        """Before waiting for the coordinator's decision on this round, let it hear the rounds the group decided
        without it: back but behind the group, it cannot reach this round until it has decided those, and a
        member waiting here would otherwise hold them back until the coordinator gave up on the group's
        reports (a chaos soak saw it commit a lone restarted peer's round instead, and the group resync).
        The entries stay in the backlog: ``peer.backlog`` reports them again (a late report is ignored) and
        checks every decision against the group's."""
        for entry in list(self.backlog):
            number = entry.request.round
            self.call(lambda: self.client.report_round(entry.request), f"report round {number}")  # noqa: B023
            self.await_decision(number)

    def decide_by_group(self, vote: Vote, request: pb.ReportRoundRequest, error: Exception) -> Optional[Decision]:
        if not self.coordinator_decided:
            # a restarted process that has not yet taken part in a round the coordinator decided does not know where
            # its group is: restarted while the coordinator was behind the group (it had not heard the group's rounds
            # yet), it was planned into a round the group had played long ago (a chaos soak saw three restarted
            # processes decide two such rounds among themselves and resync)
            logger.warning("%s %s; this restarted process has not yet taken part in a round the coordinator decided: "
                           "waiting for the coordinator", self.tag(vote.round_no), clause(error))
            return None
        if len(vote.group) <= 1 and len(self.last_group or ()) > 1:
            # alone where others were planned: its groupmates are in another round (a process restarted into the
            # round the coordinator last had open, while they went on without it), so a decision of its own would
            # only split it off from them (a chaos soak saw one go on alone for six rounds, then resync)
            logger.warning("%s %s; this peer averaged alone where %d peers were planned: waiting for the coordinator",
                           self.tag(vote.round_no), clause(error), len(self.last_group))
            return None
        decided = self.group_decision(vote)
        if decided is None:
            if vote.group:
                logger.warning("%s %s; not every groupmate's vote arrived, waiting for the coordinator",
                               self.tag(vote.round_no), clause(error))
            return None
        committed = decided.committed_hash
        # the votes go with the report: a member whose process dies before it can report still counts
        request.group_votes.extend(decided.votes)
        self.backlog.append(Backlogged(request, committed))
        logger.warning("%s coordinator unreachable; round decided by the group's votes: %s", self.tag(vote.round_no),
                       f"committed {committed}" if committed else "voided")
        return Decision(vote.round_no, committed, by_group=True, holders=decided.holders)

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
                self._give_up_if_gone(time.monotonic() - unreachable_since, f"waiting for the decision of round {round_no}")
            if info is not None and info.outcome in DECIDED:
                return info
            time.sleep(self.poll_s if info is not None else 1.0)  # polled: there is no push

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

    def leave(self, last_heartbeat: Optional[pb.HeartbeatRequest], reason: str = "peer exiting") -> None:
        """A last heartbeat carries the final numbers (if any), then the peer leaves; best effort both (the
        lease expires anyway)."""
        beat = [] if last_heartbeat is None else [lambda: self.client.heartbeat(last_heartbeat)]
        for call in [*beat, lambda: self.client.leave(peer_id=self.peer_id, reason=reason)]:
            try:
                call()
            except Exception as e:
                logger.debug("%s leaving: %r", self.tag(None), e)

    def take_backlog(self) -> list[Backlogged]:
        backlog, self.backlog = self.backlog, []
        return backlog

    # ---- helpers -------------------------------------------------------------------------------------
    def report_request(self, vote: Vote) -> pb.ReportRoundRequest:
        averaged = vote.averaged
        return pb.ReportRoundRequest(
            peer_id=self.peer_id, round=vote.round_no, ok=vote.ok, state_hash=vote.state_hash, group=vote.group,
            samples=vote.contribution.samples, inner_steps=vote.train.steps, inner_time_s=vote.train.inner_time_s,
            exchange_time_s=averaged.seconds if averaged else 0.0,
            bytes_sent=averaged.bytes_sent if averaged else 0,
            bytes_received=averaged.bytes_received if averaged else 0, loss=vote.train.mean_loss,
            error=vote.error.encode()[:MAX_REPORTED_ERROR_BYTES].decode(errors="ignore"), param_count=self.param_count,
            upload_mbit_s=averaged.upload_mbit_s if averaged else math.nan,
            download_mbit_s=averaged.download_mbit_s if averaged else math.nan,
            rtt_ms=averaged.rtt_ms if averaged else math.nan,
        )

    @staticmethod
    def _decision(round_no: int, info: pb.RoundInfo) -> Decision:
        committed = info.committed_hash if info.outcome == pb.ROUND_OUTCOME_COMMITTED else None
        return Decision(round_no, committed, finished=info.finished, holders=list(info.holders))

    def call(self, fn, what: str):
        """``fn()``, retrying while the coordinator is unreachable: PeerExit(0) when the peer is stopped; Departed
        when the coordinator said the run finished and then stopped answering (it does not come back for a
        finished run); PeerExit(1), after one sentence, when it stays unreachable ``give_up_after_s``."""
        finished = self.final is not None
        limit = FINISHED_RETRY_S if finished else self.give_up_after_s
        started = time.monotonic()
        result = with_retry(fn, what=f"{self.tag(None)} {what}", stop=self.stop, give_up_after_s=limit)
        if result is not None:
            return result
        if self.stop.is_set():
            raise PeerExit(0)
        if finished:
            raise Departed()
        self._give_up_if_gone(max(time.monotonic() - started, limit or 0.0), what)
        raise PeerExit(1)  # unreachable: give_up_if_gone raised (with_retry gives up only with a limit)

    def _give_up_if_gone(self, unreachable_s: float, waiting_for: str) -> None:
        """Raise when the coordinator has been unreachable too long for a peer that has nothing to do without it:
        Departed once it said the run finished, else PeerExit(1) after ``give_up_after_s``, with one sentence."""
        if self.final is not None and unreachable_s >= FINISHED_RETRY_S:
            raise Departed()
        if self.give_up_after_s is None or unreachable_s < self.give_up_after_s:
            return
        logger.error("%s the coordinator at %s has not answered for %.0fs (%s) and this peer has no round it can run "
                     "without it; exiting (start it again with the same --state-dir once the coordinator is back)",
                     self.tag(None), _address(self.client), unreachable_s, waiting_for)
        raise PeerExit(1)


def _address(client: CoordinatorClient) -> str:
    join = getattr(client, "join_string", None)
    return join.address if join is not None else "its address"
