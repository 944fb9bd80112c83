"""What the coordinator last said about the rounds, as the peer remembers it: the rounds' plans (participants, time
budgets, who was left out), the controller's choices, the group last planned, the live peer count, its pace, and
the run's final state once it finished.

Threads: the main thread (its polls, the round's budget and left-out checks, what the heartbeat heard) and the
round runner's executor (the exchange's ``planned`` and choice, the decision's polls) both write and read these
fields, so every one of them is read and written under ``_lock`` (the heartbeat thread touches none of them)."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from swarm.core.fragments import round_steps
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

MAX_CHOICES_KEPT = 8  # rounds whose controller choice is remembered
MAX_PACED_POLL_S = 60.0  # a paced poll interval beyond this (a coordinator's mistake) is taken as this


class RoundPlans:
    """The plan cache, fed every RoundInfo the peer hears (``remember``, ``heard``)."""

    def __init__(self, *, tag: Callable[[Optional[int]], str]) -> None:
        self.tag = tag
        self._lock = threading.Lock()  # guards every field below
        self._final: Optional[tuple[int, str]] = None  # (round, hash) once the coordinator said the run finished
        self._paced_poll_s = 0.0  # the coordinator's least time between polls (its pace; 0: none)
        self._live_peers = 0
        self._choices: dict[int, pb.RoundChoice] = {}  # round -> the controller's choice, as the coordinator said
        self._plans: dict[int, pb.RoundPlan] = {}  # the time budgets of the latest rounds seen, by round
        self._last_group: Optional[set[str]] = None  # the last group planned or played (the daemon sets it too)
        self._plan_open = False  # the last planned() answer was the coordinator's plan of the open round
        self._processes: dict[str, str] = {}  # the open round's participants' libp2p ids (``processes``)
        self.min_peers = 1  # the run's [rounds] min_peers; set once by join on the main thread before any other
        self._waiting_said: Optional[tuple[int, int]] = None  # (round, peers missing) last said while waiting

    # ---- fed by the coordinator's answers ------------------------------------------------------------
    def heard(self, info: pb.RoundInfo) -> None:
        """A RoundInfo from the coordinator (a call, or a heartbeat's answer): remember whether the run finished,
        and how often the coordinator lets a waiting peer poll it."""
        with self._lock:
            self._paced_poll_s = min(MAX_PACED_POLL_S, max(0.0, info.poll_interval_s))
            if info.finished and info.last_committed_round > 0:
                self._final = (info.last_committed_round, info.last_committed_hash)

    def remember(self, info: pb.RoundInfo, round_no: int) -> None:
        """The answer to a GetRound for ``round_no`` (0: the current round)."""
        self.heard(info)
        with self._lock:
            self._live_peers = info.live_peers
            if info.HasField("choice") and info.round not in self._choices:
                self._choices[info.round] = info.choice  # a round's choice never changes: the first answer holds
                for old in sorted(self._choices)[:-MAX_CHOICES_KEPT]:
                    del self._choices[old]
            if info.HasField("plan"):
                kept = {r: plan for r, plan in self._plans.items() if r >= info.round - 2}
                self._plans = {**kept, info.round: info.plan}
            say = round_no == 0 and self._waiting_for_peers(info)
        if say:
            next_round, missing = say
            logger.info(
                "%s waiting for %d more peer%s (min_peers = %d) before round %d opens",
                self.tag(None),
                missing,
                "" if missing == 1 else "s",
                self.min_peers,
                next_round,
            )

    def _waiting_for_peers(self, info: pb.RoundInfo) -> Optional[tuple[int, int]]:
        """(next round, peers missing) to say when no round is open and the run has fewer peers than ``min_peers``,
        once per round and shortfall (a lone first peer otherwise waits in silence); None: nothing to say.
        Under ``_lock``."""
        missing = self.min_peers - info.live_peers
        if info.open_round or info.finished or missing <= 0:
            return None
        next_round = max(info.round, info.last_committed_round) + 1
        if self._waiting_said == (next_round, missing):
            return None
        self._waiting_said = (next_round, missing)
        return next_round, missing

    def asking(self) -> None:
        """A ``planned`` question is on its way: until its answer says, the open round's plan and processes are
        unknown."""
        with self._lock:
            self._processes, self._plan_open = {}, False

    def planned(self, round_no: int, info: Optional[pb.RoundInfo]) -> Optional[set[str]]:
        """Who the coordinator planned into ``round_no`` by ``info`` (None: it did not answer); while it is down (or
        behind), the last group. A round too large for its answer to list (``participant_count`` above the list's
        length: the coordinator names only this peer's own entries) has no plan to match by: None, and the group is
        whoever posts within the matchmaking window (``swarm.net.exchange.rendezvous``)."""
        with self._lock:
            self._processes, self._plan_open = {}, False  # unknown unless this answer says
            if info is None or info.round != round_no or info.outcome != pb.ROUND_OUTCOME_OPEN:
                return self._last_group
            if info.participant_count > len(info.participants):
                self._last_group = None
                return None
            self._last_group, self._plan_open = set(info.participants), True
            if len(info.participant_dht_ids) == len(info.participants):
                self._processes = dict(zip(info.participants, info.participant_dht_ids))
            return self._last_group

    # ---- read ----------------------------------------------------------------------------------------
    @property
    def final(self) -> Optional[tuple[int, str]]:
        with self._lock:
            return self._final

    @property
    def paced_poll_s(self) -> float:
        with self._lock:
            return self._paced_poll_s

    @property
    def live_peers(self) -> int:
        with self._lock:
            return self._live_peers

    @property
    def plan_open(self) -> bool:
        with self._lock:
            return self._plan_open

    @property
    def last_group(self) -> Optional[set[str]]:
        with self._lock:
            return self._last_group

    @last_group.setter
    def last_group(self, group: Optional[set[str]]) -> None:
        with self._lock:
            self._last_group = group

    def processes(self) -> dict[str, str]:
        """Peer id -> the libp2p id of its current process, as of the last ``planned`` answer ({}: unknown)."""
        with self._lock:
            return self._processes

    def choice(self, round_no: int) -> Optional[pb.RoundChoice]:
        with self._lock:
            return self._choices.get(round_no)

    def knows_choice(self, round_no: int) -> bool:
        with self._lock:
            return round_no in self._choices

    def plan(self, round_no: int) -> Optional[pb.RoundPlan]:
        with self._lock:
            return self._plans.get(round_no)

    def budget(self, round_no: int, plan: pb.RoundPlan, peer_id: str, full: tuple[int, int]) -> tuple[int, int]:
        """(steps before a carried merge, steps) for ``round_no`` by ``plan``: the coordinator's time budget for
        ``peer_id``, capped at what a full-speed peer does in the round (``full``: at the run's H; with the controller
        on, at the H it chose for the round), the split staying ``full[0]`` (τ); ``full`` when the plan has no
        budget for it."""
        mine = next((p.inner_steps for p in plan.peers if p.peer_id == peer_id), 0)
        if mine <= 0:
            return full
        choice = self.choice(round_no)
        longest = round_steps(round_no, choice.inner_steps, choice.fragments) if choice and choice.fragments > 0 else 0
        steps = min(max(full[1], longest), mine)
        return min(full[0], steps), steps
