"""The round runner with in-process fakes for its collaborators: what one peer does with every kind of
decision, a groupmate failing at each phase, a lost report, overlap, and leaving mid-round."""

import concurrent.futures
import dataclasses
import threading

import pytest
import torch

from swarm.config import DataConfig, ModelConfig, RoundConfig, RunConfig
from swarm.core.state import GlobalState
from swarm.train.contribution import Contribution
from swarm.train.round import Averaged, Decision, Hooks, InlineExecutor, Outcome, RoundRunner, SyncFailed, Vote
from swarm.train.trainer import LocalTrainer

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

RUN = RunConfig(
    seed=0,
    model=ModelConfig(preset="bench"),
    data=DataConfig(max_bytes=200_000, num_shards=2, batch_size=2, seq_len=16, eval_batches=1),
    rounds=RoundConfig(inner_steps=2, max_rounds=10),
).validate()


class FakeGroup:
    """The group exchange: a groupmate's Δ is a fixed tensor; ``fail_at`` makes round r's exchange fail
    the way a groupmate dying in any phase does (the real exchange raises; the runner sees SyncFailed)."""

    def __init__(self, other: float = 0.0, fail_at: frozenset = frozenset()):
        self.other, self.fail_at = other, fail_at
        self.posted: list[Vote] = []

    def average(self, round_no: int, contribution: Contribution) -> Averaged:
        if round_no in self.fail_at:
            raise SyncFailed(f"round {round_no}: a groupmate stopped answering")
        mine, theirs = contribution.delta, torch.full_like(contribution.delta, self.other)
        return Averaged(average=(mine + theirs) / 2, group=["me", "mate"], bytes_sent=4 * mine.numel())

    def post(self, vote: Vote) -> None:
        self.posted.append(vote)


class FakeDecider:
    """The coordinator: ``rule(vote)`` gives the committed hash (None: void)."""

    def __init__(self, rule=lambda vote: vote.state_hash or None, planned: bool = True):
        self.rule, self.planned = rule, planned
        self.votes: list[Vote] = []

    def decide(self, vote: Vote) -> Decision:
        self.votes.append(vote)
        return Decision(vote.round_no, self.rule(vote), holders=["mate"])

    def still_planned(self, round_no: int) -> bool:
        return self.planned


class FakeStore:
    def __init__(self):
        self.votes, self.committed_rounds, self.voided_rounds = [], [], []

    def save_vote(self, state: GlobalState) -> None:
        self.votes.append(state.round_no)

    def committed(self, state: GlobalState, *, provisional: bool) -> None:
        self.committed_rounds.append((state.round_no, provisional))

    def voided(self, round_no: int, *, provisional: bool) -> None:
        self.voided_rounds.append(round_no)


class Recorder(Hooks):
    def __init__(self):
        self.phases, self.results, self.evals = [], [], []

    def at(self, round_no, phase):
        self.phases.append((round_no, phase))

    def decided(self, result):
        self.results.append(result)

    def evaluated(self, round_no, loss):
        self.evals.append(round_no)


def make(run=RUN, group=None, decider=None, stopping=lambda: False):
    trainer = LocalTrainer(run, peer_index=0)
    parts = dict(exchange=group or FakeGroup(), decider=decider or FakeDecider(), store=FakeStore(), hooks=Recorder())
    runner = RoundRunner(trainer, run, votes=parts["exchange"], executor=InlineExecutor(), stopping=stopping, **parts)
    return runner, parts


def test_a_round_commits_the_voted_state_and_goes_through_every_phase_in_order():
    runner, parts = make()
    before = runner.trainer.state
    result = runner.run_round(1)
    assert result.outcome is Outcome.COMMITTED and runner.trainer.round_no == 1
    vote = parts["decider"].votes[0]
    assert vote.ok and vote.state_hash == runner.trainer.state.state_hash != before.state_hash
    assert parts["exchange"].posted == [vote]  # posted in the DHT before the coordinator decides
    assert parts["store"].votes == [1] and parts["store"].committed_rounds == [(1, False)]
    assert parts["hooks"].phases == [(1, "trained"), (1, "averaged")]
    assert parts["hooks"].evals == [1]  # eval_every_rounds = 1


def test_a_voided_round_keeps_theta_g_and_its_work_counts_in_the_next_contribution():
    runner, parts = make(decider=FakeDecider(rule=lambda vote: None))
    before = runner.trainer.state
    result = runner.run_round(1)
    assert result.outcome is Outcome.VOIDED and runner.trainer.state is before
    assert parts["store"].voided_rounds == [1] and parts["store"].committed_rounds == []
    runner.decider.rule = lambda vote: vote.state_hash
    runner.run_round(2)
    second = parts["decider"].votes[1]
    assert second.contribution.samples == 2 * RUN.rounds.inner_steps * RUN.data.batch_size  # both rounds' work


@pytest.mark.parametrize("others_commit", [True, False])
def test_a_groupmate_failing_mid_exchange_leaves_this_peer_behind_or_voids_the_round(others_commit):
    """Whatever phase a groupmate dies in, this peer's exchange fails: it votes not-ok with no hash; the
    round then commits the others' state (this peer is BEHIND and must sync) or is voided."""
    decider = FakeDecider(rule=lambda vote: "0123456789abcdef" if others_commit else None)
    runner, parts = make(group=FakeGroup(fail_at=frozenset({1})), decider=decider)
    before = runner.trainer.state
    result = runner.run_round(1)
    vote = decider.votes[0]
    assert not vote.ok and vote.state_hash == "" and "stopped answering" in vote.error
    assert parts["store"].votes == []  # nothing tentative to write
    assert runner.trainer.state is before
    assert result.outcome is (Outcome.BEHIND if others_commit else Outcome.VOIDED)


@pytest.mark.parametrize("phase", ["matchmaking", "sending", "reducing", "averaged", "reported"])
def test_a_groupmate_crashing_at_any_phase_leaves_every_survivor_with_the_same_outcome(phase):
    """Two survivors and a groupmate that crashes at ``phase``. Before the average is complete (matchmaking,
    sending, reducing) every survivor's exchange fails and the round is voided; after it (averaged,
    reported) the survivors hold the same tentative state and the commit rule over their votes commits it."""
    exchange_fails = phase in ("matchmaking", "sending", "reducing")
    group = FakeGroup(other=0.5, fail_at=frozenset({1}) if exchange_fails else frozenset())
    votes = []

    class CommitRule(FakeDecider):  # the coordinator's rule over the votes that arrived
        def decide(self, vote):
            votes.append(vote)
            ok = [v.state_hash for v in votes if v.ok]
            return Decision(vote.round_no, min(ok) if ok else None)

    runners = [make(group=group, decider=CommitRule())[0] for _ in range(2)]
    outcomes = [r.run_round(1).outcome for r in runners]
    assert outcomes == [Outcome.VOIDED] * 2 if exchange_fails else [Outcome.COMMITTED] * 2
    assert runners[0].trainer.state.state_hash == runners[1].trainer.state.state_hash


def test_a_committed_hash_this_peer_does_not_hold_leaves_it_behind_without_touching_its_state():
    runner, parts = make(decider=FakeDecider(rule=lambda vote: "ffffffffffffffff"))
    before = runner.trainer.state
    assert runner.run_round(1).outcome is Outcome.BEHIND
    assert runner.trainer.state is before and parts["store"].committed_rounds == []


def test_a_lost_report_still_commits_when_the_decision_names_this_peers_hash():
    """The coordinator never counted this peer's report (it was lost); the others' votes committed the
    same hash, which this peer holds: it commits like everyone else."""
    runner, parts = make(decider=FakeDecider(rule=lambda vote: vote.state_hash))
    assert runner.run_round(1).outcome is Outcome.COMMITTED


def test_a_group_decision_commits_provisionally():
    class GroupDecider(FakeDecider):
        def decide(self, vote):
            return dataclasses.replace(super().decide(vote), by_group=True)

    runner, parts = make(decider=GroupDecider())
    assert runner.run_round(1).outcome is Outcome.COMMITTED
    assert parts["store"].committed_rounds == [(1, True)]


def test_with_overlap_the_exchange_lands_after_tau_steps_of_the_next_round():
    run = RUN.replace(rounds=dataclasses.replace(RUN.rounds, inner_steps=4, overlap_steps=1, max_rounds=2))
    runner, parts = make(run=run)
    first = runner.run_round(1)
    assert first.outcome is Outcome.IN_FLIGHT and runner.trainer.round_no == 0
    second = runner.run_round(2, first.pending)  # the last round: not overlapped
    assert second.outcome is Outcome.COMMITTED and runner.trainer.round_no == 2
    assert [r.outcome for r in parts["hooks"].results] == [Outcome.COMMITTED, Outcome.COMMITTED]


class GatedGroup(FakeGroup):
    """Round 1's exchange ends only when ``gate`` opens (or after ``timeout_s``): a slow link."""

    def __init__(self, timeout_s: float, steps_done):
        super().__init__()
        self.gate, self.timeout_s, self.steps_done = threading.Event(), timeout_s, steps_done
        self.steps_at_end = None

    def average(self, round_no, contribution):
        if round_no == 1:
            self.gate.wait(self.timeout_s)
            self.steps_at_end = self.steps_done()
        return super().average(round_no, contribution)


@pytest.mark.parametrize("when_ready", [True, False])
def test_with_merge_when_ready_training_goes_on_past_tau_until_the_slow_exchange_ends(when_ready):
    # τ = 1 of H = 8: round 1's exchange ends only after the trainer has run 4 steps of round 2 (one slow
    # link). Merging when ready, the peer keeps training meanwhile and merges then; at exactly τ it stands
    # still until the exchange gives up waiting, having trained τ steps.
    run = RUN.replace(rounds=dataclasses.replace(RUN.rounds, inner_steps=8, overlap_steps=1, max_rounds=2))
    trainer, hooks = LocalTrainer(run, peer_index=0), Recorder()
    group = GatedGroup(timeout_s=30 if when_ready else 1.0, steps_done=lambda: trainer.inner_steps_done)
    train = trainer.train

    def counting(steps):
        stats = train(steps)
        if trainer.inner_steps_done >= 8 + 4:
            group.gate.set()
        return stats

    trainer.train = counting
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        runner = RoundRunner(
            trainer,
            run,
            exchange=group,
            votes=group,
            decider=FakeDecider(),
            store=FakeStore(),
            executor=executor,
            hooks=hooks,
            merge_when_ready=when_ready,
        )
        first = runner.run_round(1)
        assert first.outcome is Outcome.IN_FLIGHT
        second = runner.run_round(2, first.pending)
    assert [r.outcome for r in hooks.results] == [Outcome.COMMITTED, Outcome.COMMITTED]
    assert second.outcome is Outcome.COMMITTED and trainer.round_no == 2
    assert trainer.inner_steps_done == 16  # the round's 8 steps either way, split differently around the merge
    waited = hooks.results[0].waited_s
    if when_ready:
        assert group.steps_at_end >= 12 and waited < 0.5  # merged once the exchange ended, training all along
    else:
        assert group.steps_at_end == 9 and waited >= 0.5  # stood still at τ = 1 step


def test_a_peer_no_longer_planned_stops_after_finishing_the_carried_round():
    run = RUN.replace(rounds=dataclasses.replace(RUN.rounds, inner_steps=4, overlap_steps=1))
    runner, parts = make(run=run, decider=FakeDecider(planned=False))
    first = runner.run_round(1)
    result = runner.run_round(2, first.pending)
    assert result.outcome is Outcome.NOT_PLANNED and runner.trainer.round_no == 1


def test_a_leaving_peer_does_not_send_its_round():
    runner, parts = make(stopping=lambda: True)
    assert runner.run_round(1).outcome is Outcome.STOPPED
    assert parts["decider"].votes == [] and parts["exchange"].posted == []


def test_the_trainers_clock_hears_every_step_as_it_ends_and_adds_up_to_the_rounds_inner_time():
    # a peer's live inner seconds (its utilization in `swarm status`) move a step at a time, not a round
    trainer, heard = LocalTrainer(RUN, peer_index=0), []
    trainer.clock = heard.append
    stats = trainer.train(5)
    assert len(heard) == 5 + 1  # each step as it ends, then the rest of the call
    assert sum(heard) == pytest.approx(stats.inner_time_s, rel=1e-9, abs=1e-9)
