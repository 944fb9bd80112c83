"""The round, written once: the peer daemon and the simulator both run every round through ``RoundRunner``.

One round r, from one peer's side (f = the fragment round r syncs; F = 1: every parameter):

    train the round's inner steps → take Δ_f (the contribution) → exchange it with the group →
    tentative θg' = OuterOpt(θg, Δ̄) → durable vote (on disk, then posted) → decision →
    commit θg' if it is the committed state, keep θg (and Δ's work) if the round was voided,
    or report BEHIND: the caller syncs the committed state from a holder.

With overlap τ (Streaming DiLoCo) the exchange of round r runs in the background while the first τ
inner steps of round r + 1 train; ``run_round(r + 1, carry=<round r in flight>)`` finishes it there.

The runner's collaborators are small interfaces, so the daemon passes the real ones (hivemind, the
gRPC coordinator, the disk) and the simulator in-process ones:

- ``GroupExchange.average``: find the round's group and average the contributions, as the contribution's round
  plan says (its codec and shares: ``swarm.train.round_plan``, made here once per round; raises SyncFailed);
- ``VoteBoard``: durable votes, and the group's own decision when the coordinator cannot be reached;
- ``Decider.decide``: the coordinator's decision on a round (it may fall back to the vote board), and
  ``Decider.round_choice``: the coordinator's controller choice the round's plan is made from;
- ``StateStore``: where tentative and committed states go (vote files, checkpoints, the state server).

Threads: ``run_round`` and ``finish`` run on the caller's thread and own the trainer; the exchange and
the decision run on ``executor`` and only read the trainer's committed state (``apply`` is pure) until
``finish`` joins them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from swarm.config import RunConfig
from swarm.core.state import GlobalState
from swarm.train.contribution import Contribution, TrainStats
from swarm.train.round_plan import ControllerChoice, PlanRefused, RoundPlan, plan_round
from swarm.train.trainer import LocalTrainer


class SyncFailed(RuntimeError):
    """This peer's exchange of a round failed (no group, a groupmate died, a timeout): it votes not-ok."""


class Outcome(enum.Enum):
    COMMITTED = "committed"  # this peer holds the committed state of the round
    VOIDED = "voided"  # nobody applied the round; θg is unchanged and θl keeps the round's work
    BEHIND = "behind"  # the round committed a state this peer does not hold: sync it before going on
    IN_FLIGHT = "in flight"  # the exchange overlaps the next round; ``pending`` finishes it
    NOT_PLANNED = "not planned"  # the previous round finished, but this peer is not in this round
    STOPPED = "stopped"  # the peer is leaving; the round's work was not sent


RELEASED = torch.empty(0)  # an Averaged's average once it was applied (the round keeps only the exchange's numbers)


@dataclass(frozen=True)
class Averaged:
    """What a finished exchange gives this peer: Δ̄ of the fragment, identical on every groupmate."""

    average: torch.Tensor
    group: list[str]  # the groupmates' peer ids, this peer included
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    # what this peer, as the owner of its slice, did to groupmates' contributions (robust aggregation)
    contributions_rejected: int = 0
    contributions_clipped: int = 0
    foreign_messages_dropped: int = 0  # slices or aborts from a libp2p id that is not the member it claims
    # this peer's link estimates after the exchange (EWMA over exchanges; NaN: not measured yet)
    upload_mbit_s: float = math.nan
    download_mbit_s: float = math.nan
    rtt_ms: float = math.nan


@dataclass(frozen=True)
class Vote:
    round_no: int
    fragment: int
    ok: bool
    state_hash: str  # of the tentative state; "" when the exchange failed
    group: list[str]
    contribution: Contribution
    train: TrainStats
    averaged: Optional[Averaged] = None
    error: str = ""
    vote_s: float = 0.0  # the outer step, its hash and the vote on disk: local work, not the exchange's


@dataclass(frozen=True)
class Decision:
    round_no: int
    committed_hash: Optional[str]  # None: voided
    finished: bool = False  # the run ends with this round
    by_group: bool = False  # decided from the group's votes while the coordinator was unreachable
    holders: list[str] = field(default_factory=list)  # who holds the committed state (DHT peer ids)


class GroupExchange(Protocol):
    def average(self, round_no: int, contribution: Contribution) -> Averaged: ...


class VoteBoard(Protocol):
    def post(self, vote: Vote) -> None: ...


class Decider(Protocol):
    def decide(self, vote: Vote) -> Decision: ...

    def still_planned(self, round_no: int) -> bool: ...

    def round_choice(self, round_no: int) -> Optional[ControllerChoice]:
        """The coordinator's controller choice for a round (None: none, the run's config); asked only in a run whose
        controller is on, as the round's contribution is taken."""


class StateStore(Protocol):
    def save_vote(self, state: GlobalState) -> None: ...

    def committed(self, state: GlobalState, *, provisional: bool) -> None: ...

    def voided(self, round_no: int, *, provisional: bool) -> None: ...


class Hooks:
    """Observation and fault-injection points of a round; the default does nothing."""

    def at(self, round_no: int, phase: str) -> None:
        """phase: 'trained' (inner steps done), 'averaged' (exchange over), 'reported' (vote sent)."""

    def trained(self, round_no: int, stats: TrainStats) -> None: ...

    def exchanging(self, round_no: int) -> None:
        """The contribution is taken and its exchange starts (on the caller's thread)."""

    def deciding(self, round_no: int) -> None:
        """The caller's thread starts waiting for the round's decision."""

    def voted(self, vote: Vote) -> None: ...

    def decided(self, result: "RoundResult") -> None: ...

    def evaluated(self, round_no: int, loss: float) -> None: ...


@dataclass
class Pending:
    """A round whose exchange and decision run on the executor."""

    round_no: int
    fragment: int
    contribution: Contribution
    train: TrainStats
    future: concurrent.futures.Future  # of (Vote, Decision, tentative GlobalState or None)
    contribution_s: float = 0.0  # taking the contribution (Δ and its residual)


@dataclass(frozen=True)
class RoundResult:
    round_no: int
    outcome: Outcome
    decision: Optional[Decision] = None
    pending: Optional[Pending] = None  # IN_FLIGHT only
    group: list[str] = field(default_factory=list)
    waited_s: float = 0.0  # how long training stood still for this round's exchange and decision
    # the round's local work that is neither inner steps nor the exchange: Δ, the outer step, its hash, the vote
    # on disk, the commit and what it publishes (docs/BENCHMARKS.md, "Real model sizes"); and its evaluation
    overhead_s: float = 0.0
    eval_s: float = 0.0


class InlineExecutor(concurrent.futures.Executor):
    """Runs a submitted call at once on the caller's thread (the simulator's exchange needs no thread)."""

    def submit(self, fn, /, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # re-raised by future.result() in finish, on the round's thread
            future.set_exception(e)
        return future


class RoundRunner:
    def __init__(
        self,
        trainer: LocalTrainer,
        run: RunConfig,
        *,
        exchange: GroupExchange,
        votes: VoteBoard,
        decider: Decider,
        store: StateStore,
        executor: concurrent.futures.Executor,
        hooks: Optional[Hooks] = None,
        stopping: Callable[[], bool] = lambda: False,
        evaluate: bool = True,
        budget: Optional[Callable[[int], tuple[int, int]]] = None,
        left_out: Callable[[int], bool] = lambda round_no: False,
        merge_when_ready: bool = False,
        passed_over: Optional[Callable[[int], bool]] = None,
    ) -> None:
        self.trainer, self.run = trainer, run
        self.exchange, self.votes, self.decider, self.store = exchange, votes, decider, store
        self.executor = executor
        self.hooks = hooks or Hooks()
        self.stopping = stopping
        self.evaluate = evaluate  # evaluate θg on the run's eval rounds (the simulator asks one peer only)
        # (steps before a carried merge, steps in the round) for a round; asked again once a carried round
        # is finished, when the round's plan (its time budget) is known
        self.budget = budget or self.full_speed
        self.left_out = left_out  # the round went on without this peer (too slow): asked once its steps are done
        # asked between parts of a round's inner steps, so it must be cheap (a peer: what its heartbeat last heard):
        # the swarm went on without this round, so this peer stops training it. None: a round's steps in one call.
        self.passed_over = passed_over
        # τ as a minimum: after τ steps, keep training while the carried exchange is still running and merge at the
        # first step it has finished (the controller's runs: a slow exchange no longer idles the peer). Off, the
        # merge is at exactly τ steps, which the simulator reproduces bit for bit.
        self.merge_when_ready = merge_when_ready

    def full_speed(self, round_no: int) -> tuple[int, int]:
        """(inner steps before a carried exchange is merged, inner steps in the round) for round_no."""
        plan = plan_round(self.run.rounds, round_no)
        return plan.overlap_steps, plan.steps

    def plan(self, round_no: int) -> tuple[RoundPlan, str]:
        """Round ``round_no``'s plan (``plan_round``: the controller's choice, if the run has a controller, else the
        run's config), and "" or why the coordinator's choice cannot be run: the round's exchange then fails."""
        rounds = self.run.rounds
        choice = self.decider.round_choice(round_no) if rounds.controller != "off" else None
        try:
            return plan_round(rounds, round_no, choice), ""
        except PlanRefused as e:
            return plan_round(rounds, round_no), str(e)

    def run_round(self, round_no: int, carry: Optional[Pending] = None) -> RoundResult:
        """Train round ``round_no`` and exchange it. ``carry`` is the previous round, still in flight:
        it is finished after the first τ inner steps. Returns IN_FLIGHT when this round's exchange
        overlaps the next round, else the round's outcome (or the carried round's, if that one left
        this peer BEHIND or out of this round)."""
        rounds = self.run.rounds
        before_merge, steps = self.budget(round_no)
        parts = []
        if carry is not None:
            parts.append(self.trainer.train(before_merge))
            if self.merge_when_ready:
                parts += self._train_while(lambda: not carry.future.done(), steps - before_merge)
            previous = self.finish(carry)
            if previous.outcome is Outcome.BEHIND:
                return previous
            if not self.decider.still_planned(round_no):
                return RoundResult(round_no, Outcome.NOT_PLANNED)
            done = sum(p.steps for p in parts)
            steps = max(self.budget(round_no)[1], done)
            steps -= done
        rest = self._train_unless_passed_over(round_no, steps)
        if rest is None:
            return RoundResult(round_no, Outcome.NOT_PLANNED)
        train = combine(parts + [rest]) if parts else rest
        self.hooks.trained(round_no, train)
        self.hooks.at(round_no, "trained")
        if self.stopping():
            return RoundResult(round_no, Outcome.STOPPED)
        if self.left_out(round_no):
            return RoundResult(round_no, Outcome.NOT_PLANNED)
        pending = self.start(round_no, train)
        last = rounds.max_rounds is not None and round_no >= rounds.max_rounds
        if rounds.overlap_steps > 0 and not last:
            return RoundResult(round_no, Outcome.IN_FLIGHT, pending=pending)
        return self.finish(pending)

    def _train_unless_passed_over(self, round_no: int, steps: int) -> Optional[TrainStats]:
        """``steps`` inner steps of ``round_no``; None when the swarm went on without this round meanwhile (asked
        before each part of 1/16 of them, ``_train_while``: parts train the same bits as one call). A peer that is
        far slower than its start-up probe said (or stalls) then stops at once instead of training a lost round."""
        if self.passed_over is None or steps <= 0:
            return self.trainer.train(steps)
        parts = self._train_while(lambda: not self.passed_over(round_no), steps)
        trained = parts[0] if len(parts) == 1 else combine(parts)
        if trained.steps == steps:
            return trained
        if parts:  # what it trained still tells its speed (a peer: its heartbeat reports the measured step time)
            self.hooks.trained(round_no, trained)
        return None

    def _train_while(self, busy: Callable[[], bool], most: int) -> list[TrainStats]:
        """Inner steps while ``busy()``, at most ``most``, in chunks of 1/16 of them (a chunk is one call to the
        trainer: on a multi-GPU peer it starts every rank)."""
        parts: list[TrainStats] = []
        done, chunk = 0, max(1, most // 16)
        while done < most and busy() and not self.stopping():  # a stopping peer leaves between chunks
            parts.append(self.trainer.train(min(chunk, most - done)))
            done += parts[-1].steps
        return parts

    def start(self, round_no: int, train: TrainStats) -> Pending:
        plan, refused = self.plan(round_no)
        started = time.perf_counter()
        contribution = self.trainer.take_contribution(plan.fragment)
        contribution.plan = plan  # before the exchange sees it: it travels with the contribution from here
        contribution_s = time.perf_counter() - started
        self.hooks.exchanging(round_no)
        future = self.executor.submit(self._exchange_and_decide, round_no, contribution, train, refused)
        return Pending(round_no, plan.fragment, contribution, train, future, contribution_s=contribution_s)

    def _exchange_and_decide(self, round_no: int, contribution: Contribution, train: TrainStats, refused: str = ""):
        """On the executor: average, tentative outer step, durable vote, decision. ``refused``: why the round's plan
        cannot be run (its exchange fails)."""
        tentative, averaged, error, vote_s = None, None, "", 0.0
        try:
            if refused:
                raise SyncFailed(refused)
            if contribution.samples <= 0:
                raise SyncFailed(f"round {round_no}: no inner steps since fragment {contribution.fragment} last synced")
            averaged = self.exchange.average(round_no, contribution)
            started = time.perf_counter()
            tentative = self.trainer.apply(averaged.average, contribution.fragment, round_no)
            # applied (the outer step keeps copies): the vote keeps the exchange's numbers, not its model-sized
            # result, whose memory the next exchange may then reuse (swarm.net.exchange.result_vectors)
            averaged = dataclasses.replace(averaged, average=RELEASED)
            self.store.save_vote(tentative)  # before the hash is reported: the round survives on disk
            tentative.state_hash  # noqa: B018  (computed once, here, when the vote did not already)
            vote_s = time.perf_counter() - started
        except SyncFailed as e:
            error = str(e)
        self.hooks.at(round_no, "averaged")
        vote = Vote(
            round_no=round_no,
            fragment=contribution.fragment,
            ok=tentative is not None,
            state_hash=tentative.state_hash if tentative is not None else "",
            group=averaged.group if averaged else [],
            contribution=contribution,
            train=train,
            averaged=averaged,
            error=error,
            vote_s=vote_s,
        )
        self.hooks.voted(vote)
        self.votes.post(vote)
        decision = self.decider.decide(vote)
        return vote, decision, tentative

    def finish(self, pending: Pending) -> RoundResult:
        """Wait for ``pending``'s decision and apply it: commit, keep the voided round's work, or BEHIND."""
        self.hooks.deciding(pending.round_no)
        started = time.perf_counter()
        vote, decision, tentative = pending.future.result()
        waited = time.perf_counter() - started
        result = dataclasses.replace(self._apply(pending, vote, decision, tentative), waited_s=waited)
        self.hooks.decided(result)
        return result

    def _apply(self, pending: Pending, vote: Vote, decision: Decision, tentative: Optional[GlobalState]) -> RoundResult:
        round_no = pending.round_no
        if decision.committed_hash is None:
            self.trainer.return_contribution(pending.contribution)
            self.store.voided(round_no, provisional=decision.by_group)
            return RoundResult(round_no, Outcome.VOIDED, decision, group=vote.group)
        if tentative is None or decision.committed_hash != tentative.state_hash:
            if pending.contribution.owner is not None:  # its staged residuals belong to an average nobody applied
                pending.contribution.owner.discard()
            return RoundResult(round_no, Outcome.BEHIND, decision, group=vote.group)
        started = time.perf_counter()
        self.trainer.record_sent(pending.contribution, parts=len(vote.group) if vote.group else None)
        self.trainer.commit(tentative, fragment=pending.fragment)
        self.store.committed(tentative, provisional=decision.by_group)
        evaluated = time.perf_counter()
        if self.evaluate and (decision.finished or round_no % self.run.rounds.eval_every_rounds == 0):
            self.hooks.evaluated(round_no, self.trainer.eval_loss())
        done = time.perf_counter()
        return RoundResult(
            round_no,
            Outcome.COMMITTED,
            decision,
            group=vote.group,
            overhead_s=pending.contribution_s + vote.vote_s + evaluated - started,
            eval_s=done - evaluated,
        )


def combine(parts: list[TrainStats]) -> TrainStats:
    """One TrainStats for inner steps run in several parts (before and after an overlapped merge)."""
    steps = sum(p.steps for p in parts)
    loss = sum(p.mean_loss * p.steps for p in parts if p.steps) / steps if steps else math.nan
    return TrainStats(
        steps=steps,
        samples=sum(p.samples for p in parts),
        tokens=sum(p.tokens for p in parts),
        mean_loss=loss,
        inner_time_s=sum(p.inner_time_s for p in parts),
    )
