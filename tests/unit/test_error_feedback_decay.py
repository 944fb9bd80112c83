"""SparseLoCo's error feedback: the residual decays by β per round (e ← β·e + Δ; send top-k of e; e −= sent),
named in the run config; β = 1 is the classic rule bit for bit, and with β < 1 every peer and the simulator
still end on the same θg bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.config import ConfigError, OuterOptConfig, RunConfig
from swarm.core.all_gather import gather_reference
from swarm.core.codecs.codec import get_codec
from swarm.core.codecs.error_feedback import ErrorFeedback
from swarm.train.simulator.sim import simulate
from swarm.train.trainer import LocalTrainer
from tests.unit.test_trainer_sim import RUN

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

NUMEL = 3 * 4096 + 77


def _deltas(seed: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g) for _ in range(count)]


def test_the_residual_decays_by_beta_and_holds_what_was_not_sent():
    codec, feedback = get_codec("topk-int4"), ErrorFeedback(NUMEL, decay=0.9)
    accumulator = torch.zeros(NUMEL)  # SparseLoCo's e, by its own rule
    for delta in _deltas(1, 4):
        accumulator = 0.9 * accumulator + delta
        sent_input = feedback.compensate(delta)
        assert torch.allclose(sent_input, accumulator, atol=1e-5)
        decoded = codec.decode(codec.encode(sent_input), NUMEL)
        feedback.update(sent_input, decoded)
        accumulator = accumulator - decoded
        assert torch.equal(feedback.residual, sent_input - decoded)
    assert feedback.residual.abs().max() > 0


def test_decay_one_is_the_classic_rule_bit_for_bit():
    codec = get_codec("topk-int4")
    classic, explicit = ErrorFeedback(NUMEL), ErrorFeedback(NUMEL, decay=1.0)
    for delta in _deltas(2, 3):
        a, b = classic.compensate(delta), explicit.compensate(delta)
        assert torch.equal(a, b)
        classic.update(a, codec.decode(codec.encode(a), NUMEL))
        explicit.update(b, codec.decode(codec.encode(b), NUMEL))
    with pytest.raises(ValueError, match="decay must be in"):
        ErrorFeedback(NUMEL, decay=0.0)


def test_the_run_config_names_the_decay_and_rejects_one_outside_0_1():
    run = RunConfig.from_json('{"rounds": {"codec": "topk-int4", "error_feedback_decay": 0.95}}')
    assert run.rounds.error_feedback_decay == 0.95
    assert RunConfig().rounds.error_feedback_decay == 1.0
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="error_feedback_decay must be in"):
            RunConfig.from_json(f'{{"rounds": {{"error_feedback_decay": {bad}}}}}')


def _sparse_run(decay: float) -> RunConfig:
    rounds = dataclasses.replace(RUN.rounds, inner_steps=3, codec="topk-int4@0.05", error_feedback_decay=decay)
    return RUN.replace(rounds=rounds, outer=OuterOptConfig(lr=1.0, momentum=0.0)).validate()


def test_with_decay_the_peers_and_the_simulator_end_on_the_same_bits():
    run, rounds = _sparse_run(0.9), 3
    sim = simulate(run, peers=2, rounds=rounds)
    assert sim.consistent and sim.error_feedback
    assert sim.final_hash != simulate(_sparse_run(1.0), peers=2, rounds=rounds).final_hash  # β is applied
    # The same rounds by hand, as two peers run them: Δ + β·residual, the sparse all-gather, one outer step.
    trainers = [LocalTrainer(run, peer_index=i) for i in range(2)]
    for round_no in range(1, rounds + 1):
        for t in trainers:
            t.train(run.rounds.inner_steps)
        contributions = [t.take_contribution() for t in trainers]
        average = gather_reference(
            [c.delta for c in contributions], [float(c.samples) for c in contributions], run.rounds.codec
        )
        states = [t.apply(average, None, round_no) for t in trainers]
        assert states[0].state_hash == states[1].state_hash
        for t, c, s in zip(trainers, contributions, states):
            t.record_sent(c, run.rounds.codec)
            t.commit(s)
    assert trainers[0].state.state_hash == trainers[1].state.state_hash == sim.final_hash
    assert trainers[0].error_feedback[0].decay == 0.9 and trainers[0].error_feedback[0].residual.any()
