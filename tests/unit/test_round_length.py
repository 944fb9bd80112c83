"""The controller's round length applied: when no codec hides the exchange it lengthens the round (up to
controller_max_inner_steps), the coordinator's time budgets follow that H, the peers train it, the weight
cap allows it, and θg stays identical on every peer."""

import dataclasses

import pytest

from coordinator.rounds import budgets, controller
from coordinator.store.records import RoundRecord
from swarm.config import DataConfig, RoundConfig, RunConfig
from swarm.core.aggregation import Aggregation
from swarm.core.round_length import longest_inner_steps, longest_round_steps, longest_sync_steps
from tests.unit.test_peer_lifecycle import RUN, _reported_steps, committed_hash, finish, start, swarm

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def test_the_longest_round_is_the_runs_h_or_with_the_controller_its_cap():
    assert longest_inner_steps(RoundConfig(inner_steps=10)) == 10
    assert longest_inner_steps(RoundConfig(inner_steps=10, controller="auto")) == 40
    auto = RoundConfig(inner_steps=10, controller="auto", controller_max_inner_steps=25, fragments=2)
    assert (longest_inner_steps(auto), longest_round_steps(5, auto), longest_sync_steps(auto)) == (25, 12, 26)


def test_the_weight_cap_allows_the_longest_round_the_controller_may_choose():
    """An honest peer doing a lengthened round's steps is not clipped; with the controller off the cap is
    batch x H as before."""
    off = RunConfig(data=DataConfig(batch_size=8), rounds=RoundConfig(inner_steps=50))
    on = off.replace(rounds=dataclasses.replace(off.rounds, controller="auto", controller_max_inner_steps=120))
    assert Aggregation.for_run(off).max_weight == 400.0
    assert Aggregation.for_run(on).max_weight == 8 * 120
    assert Aggregation.for_run(on).weights([8.0 * 120, 1e9], ["a", "b"]) == [960.0, 960.0]


def _row(choice_h: int) -> RoundRecord:
    choice = controller.Choice(round=3, codec="int4", inner_steps=choice_h, fragments=1, overlap_steps=0)
    return RoundRecord(round=3, participants=("a", "b"), opened_at=0.0, choice=controller.to_json(choice))


def test_the_time_budget_follows_the_controllers_h_and_slower_peers_get_their_share(monkeypatch):
    rounds = RoundConfig(inner_steps=4, controller="auto", controller_max_inner_steps=12, straggler_slack_s=0.0)
    monkeypatch.setattr(budgets, "step_times", lambda peers, of: {"a": 0.5, "b": 1.5})
    planned = budgets.budgeted(_row(12), {}, rounds)
    assert (planned.budget_s, planned.budgets) == (6.0, (12, 4))  # 12 steps of the fastest's 0.5 s
    assert budgets.budgeted(_row(100), {}, rounds).budgets == (12, 4)  # a stored H over the cap is capped
    off = dataclasses.replace(rounds, controller="off")
    assert budgets.budgeted(_row(12), {}, off).budgets == (4, 1)  # a choice counts only with the controller on


def test_a_round_the_controller_lengthens_is_trained_by_every_peer_and_keeps_them_identical(tmp_path):
    """Links a thousand times too slow for the round: from the first measured exchange the controller chooses
    int4 and the longest round it may (6 steps instead of 2), both peers train 6 steps, every round commits
    and both end on the committed hash."""
    rounds = dataclasses.replace(RUN.rounds, max_rounds=4, controller="auto", controller_max_inner_steps=6)
    run = RUN.replace(rounds=rounds).validate()
    coordinator, parts = swarm(run)
    parts.net.links = lambda peer_id, round_no: (0.001, 0.001)  # Mbit/s
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    assert finish(a, b) == [0, 0]
    store = coordinator.engine._store
    chosen = [controller.from_json(store.get_round(r).choice).inner_steps for r in range(1, 5)]
    assert chosen[0] == 2 and chosen[-1] == 6, chosen  # round 1: nothing measured yet
    steps = [_reported_steps(coordinator, r) for r in range(1, 5)]
    assert steps[0] == {"a": 2, "b": 2} and steps[-1] == {"a": 6, "b": 6}, steps
    assert all(set(s.values()) == {h} for s, h in zip(steps, chosen)), (steps, chosen)
    status = coordinator.status().run
    assert (status.rounds_committed, status.rounds_voided) == (4, 0)
    assert a.trainer.state.state_hash == b.trainer.state.state_hash == committed_hash(coordinator, 4)
