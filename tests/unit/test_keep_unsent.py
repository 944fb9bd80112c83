"""``[rounds] keep_unsent_locally``: after a round a peer restarts its inner steps from θg minus its
error-feedback residual, so the next pseudo-gradient carries what the wire has not delivered yet without
adding it a second time, and the peers still agree on θg."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.config import ConfigError, RunConfig
from swarm.core.average import butterfly_reference
from swarm.train.simulator.sim import simulate
from swarm.train.trainer import LocalTrainer
from tests.unit.test_trainer_sim import RUN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _run(keep: bool) -> RunConfig:
    return RUN.replace(
        rounds=dataclasses.replace(RUN.rounds, inner_steps=3, codec="ternary", keep_unsent_locally=keep)
    ).validate()


def test_the_next_pseudo_gradient_starts_with_the_residual_and_does_not_add_it_again():
    run = _run(True)
    trainers = [LocalTrainer(run, peer_index=i) for i in range(2)]
    for t in trainers:
        t.train(3)
    contributions = [t.take_contribution() for t in trainers]
    assert torch.equal(contributions[0].delta, trainers[0].pseudo_gradient())  # no residual added yet
    average = butterfly_reference(
        [c.delta for c in contributions], [1.0, 1.0], "ternary", owners=[c.owner for c in contributions]
    )
    for t, c in zip(trainers, contributions):
        state = t.apply(average, None, 1)
        t.record_sent(c, "ternary", parts=2)
        t.commit(state, fragment=0)
    residual = trainers[0].error_feedback[0].residual
    assert residual.abs().max() > 0
    # before any inner step, θg − θl is the residual: the next Δ holds it once
    assert torch.equal(trainers[0].take_contribution().delta, trainers[0].pseudo_gradient())
    assert torch.allclose(trainers[0].pseudo_gradient(), residual, atol=1e-6)


def test_a_simulated_run_is_consistent_and_differs_from_adding_the_residual():
    kept, added = simulate(_run(True), peers=2, rounds=3), simulate(_run(False), peers=2, rounds=3)
    assert kept.consistent and added.consistent and kept.final_hash != added.final_hash


def test_it_is_refused_where_theta_l_is_not_restarted_when_a_fragment_merges():
    for extra in ('"fragments": 2, "overlap_steps": 2', '"error_feedback": false', '"error_feedback_decay": 0.9'):
        with pytest.raises(ConfigError, match="keep_unsent_locally needs θl to restart from θg"):
            RunConfig.from_json(f'{{"rounds": {{"codec": "int4", "keep_unsent_locally": true, {extra}}}}}')


def test_streaming_fragments_keep_each_fragments_residual_and_agree():
    rounds = dataclasses.replace(RUN.rounds, inner_steps=4, codec="ternary", keep_unsent_locally=True, fragments=2)
    run = RUN.replace(rounds=rounds).validate()
    assert simulate(run, peers=2, rounds=4).consistent
    trainers = [LocalTrainer(run, peer_index=i) for i in range(2)]
    for t in trainers:
        t.train(2)
    contributions = [t.take_contribution(1) for t in trainers]
    average = butterfly_reference(
        [c.delta for c in contributions], [1.0, 1.0], "ternary", owners=[c.owner for c in contributions]
    )
    before = trainers[0].pseudo_gradient(0)
    for t, c in zip(trainers, contributions):
        state = t.apply(average, 1, 1)
        t.record_sent(c, "ternary", parts=2)
        t.commit(state, fragment=1)
    residual = trainers[0].error_feedback[1].residual
    assert residual.abs().max() > 0 and not trainers[0].error_feedback[0].residual.any()
    # fragment 1 restarted from θg − its residual; fragment 0 kept training untouched
    assert torch.allclose(trainers[0].pseudo_gradient(1), residual, atol=1e-6)
    assert torch.equal(trainers[0].pseudo_gradient(0), before)
