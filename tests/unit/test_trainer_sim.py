"""One peer's LocalTrainer and the in-process simulator: learning, consistency and determinism."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from swarm.config import DataConfig, InnerOptConfig, ModelConfig, OuterOptConfig, RoundConfig, RunConfig
from swarm.core.average import weighted_average
from swarm.core.codecs.codec import CODECS
from swarm.core.state import GlobalState, state_hash
from swarm.train.data.data import eval_loss
from swarm.train.simulator.sim import main as sim_main
from swarm.train.simulator.sim import simulate
from swarm.train.trainer import LocalTrainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


RUN = RunConfig(
    seed=0,
    model=ModelConfig(preset="tiny"),
    data=DataConfig(max_bytes=1_000_000, num_shards=4, batch_size=8, seq_len=64, eval_batches=2),
    inner=InnerOptConfig(warmup_steps=5),
    rounds=RoundConfig(inner_steps=10),
).validate()


def test_the_trainer_learns():
    trainer = LocalTrainer(RUN, peer_index=0)
    d = RUN.data
    before = trainer.eval_loss()
    stats = trainer.train(60)
    after_local = eval_loss(
        trainer.model, trainer.corpus, batch_size=d.batch_size, seq_len=d.seq_len, num_batches=d.eval_batches
    )
    assert (stats.steps, stats.samples, stats.tokens) == (60, 480, 480 * 64)
    assert before > 4.5 and after_local < before - 1.5, (before, after_local)
    assert stats.mean_loss < before
    assert trainer.local_step_time_s is not None and trainer.tokens_per_second > 0
    assert trainer.eval_loss() == before  # θg has not moved: only a commit moves it


def test_apply_is_tentative_and_commit_installs_the_state():
    trainer = LocalTrainer(RUN, peer_index=1)
    trainer.train(3)
    start_hash = trainer.state.state_hash
    delta = trainer.pseudo_gradient()
    assert delta.dim() == 1 and delta.numel() == trainer.param_count and delta.abs().sum() > 0
    tentative = trainer.apply(delta, None, 1)
    assert trainer.state.state_hash == start_hash and trainer.round_no == 0
    trainer.commit(tentative)
    assert trainer.state.state_hash != start_hash and trainer.round_no == 1
    assert all(torch.equal(a, g) for a, g in zip(trainer.model.parameters(), tentative.params))  # θl restarts from θg
    trainer.train(2)
    local = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.eval_loss()  # evaluates θg, then puts θl back
    assert all(torch.equal(a, b) for a, b in zip(local, trainer.model.parameters()))


def test_a_voided_rounds_work_is_carried_into_the_next_contribution():
    """Plain DiLoCo: a round nobody applied leaves θl where it was; the next Δ covers both rounds' steps
    and is weighted by both rounds' samples, and the error-feedback residual is not advanced."""
    run = RUN.replace(rounds=dataclasses.replace(RUN.rounds, codec="int8", error_feedback=True))
    trainer = LocalTrainer(run, peer_index=0)
    trainer.train(3)
    first = trainer.take_contribution()
    trainer.return_contribution(first)  # the round was voided: no record_sent, no commit
    assert trainer.samples_since_sync() == first.samples
    trainer.train(2)
    second = trainer.take_contribution()
    assert second.samples == first.samples * 5 // 3
    assert torch.equal(second.delta, trainer.pseudo_gradient())  # nothing from the codec was remembered
    # the same 5 steps in one go give the same Δ: nothing of the voided round was lost
    fresh = LocalTrainer(run, peer_index=0)
    fresh.train(3)
    fresh.train(2)
    assert torch.equal(second.delta, fresh.take_contribution().delta)


def test_one_peer_with_plain_outer_sgd_lands_on_its_local_parameters():
    # Outer lr 1, no momentum: θg − (θg − θl) = θl.  A sign error in Δ would land far away.
    run = RUN.replace(outer=OuterOptConfig(lr=1.0, momentum=0.0, nesterov=False))
    result = simulate(run, peers=1, rounds=1, steps_per_peer=[5])
    trainer = LocalTrainer(run, peer_index=0)
    trainer.train(5)
    for g, l in zip(result.final_params, trainer.model.parameters()):
        assert torch.allclose(g, l.detach(), atol=1e-6)


def test_simulated_peers_agree_bit_for_bit_and_learn():
    result = simulate(RUN, peers=2, rounds=2)
    assert len(result.rounds) == 2 and result.consistent
    for r in result.rounds:
        assert len(r.peer_hashes) == 2 and len(set(r.peer_hashes)) == 1
    assert result.rounds[0].state_hash != result.initial_hash != result.final_hash
    assert result.rounds[-1].eval_loss < result.initial_eval_loss - 0.5
    assert result.rounds[-1].samples == 2 * 10 * 8
    assert result.bytes_per_peer_per_round == 4 * result.param_count  # 2 (K-1)/K x 4 bytes, K = 2
    json.dumps(result.to_dict())


def test_simulation_is_deterministic():
    run = dataclasses.replace(RUN, rounds=dataclasses.replace(RUN.rounds, inner_steps=5))
    a = simulate(run, peers=2, rounds=2, steps_per_peer=[5, 3])
    b = simulate(run, peers=2, rounds=2, steps_per_peer=[5, 3])
    assert [r.state_hash for r in a.rounds] == [r.state_hash for r in b.rounds]
    assert all(
        torch.equal(x, y) for x, y in zip(a.final_params + a.final_outer_state, b.final_params + b.final_outer_state)
    )
    assert [r.eval_loss for r in a.rounds] == [r.eval_loss for r in b.rounds]


def test_a_warm_started_simulation_continues_from_the_given_parameters():
    cold = simulate(RUN, peers=2, rounds=1)
    warm = simulate(RUN, peers=2, rounds=1, initial_params=cold.final_params)
    assert warm.initial_eval_loss == cold.rounds[-1].eval_loss  # θ0 is the cold run's result
    assert warm.consistent and warm.rounds[-1].eval_loss < warm.initial_eval_loss
    start = simulate(RUN, peers=2, rounds=0, initial_params=cold.final_params)
    assert all(torch.equal(a, b) for a, b in zip(start.final_params, cold.final_params))
    assert all(not m.any() for m in start.final_outer_state)  # the outer optimizer starts from zero momentum


def test_fp16_simulation_stays_consistent_and_sends_half_the_bytes():
    result = simulate(RUN, peers=3, rounds=1, steps_per_peer=[2, 2, 2], codec="fp16")
    assert result.consistent and result.codec == "fp16"
    assert result.bytes_per_peer_per_round == pytest.approx(2 * 2 / 3 * 2 * result.param_count)


def test_bad_simulation_arguments_are_refused():
    with pytest.raises(ValueError, match="steps_per_peer"):
        simulate(RUN, peers=2, rounds=1, steps_per_peer=[3])
    with pytest.raises(ValueError, match="unknown"):
        simulate(RUN, peers=1, rounds=1, codec="int3")


def test_seq_len_longer_than_the_context_is_a_clear_error():
    run = RUN.replace(model=ModelConfig(preset="tiny", context=32))
    with pytest.raises(ValueError, match="context"):
        LocalTrainer(run, peer_index=0)


def test_sim_cli_prints_a_json_summary(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[data]\nmax_bytes = 1000000\nseq_len = 32\neval_batches = 1\nnum_shards = 2\n")
    assert sim_main(["--config", str(config), "--peers", "2", "--rounds", "1", "--steps", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peers"] == 2 and summary["consistent"] and len(summary["rounds"]) == 1


# ---- codecs, error feedback, fragments, overlap, heterogeneous peers, outer optimizers ------------


def _run(inner_steps=4, **rounds):
    return RUN.replace(rounds=dataclasses.replace(RUN.rounds, inner_steps=inner_steps, **rounds))


def test_contributions_carry_samples_and_error_feedback():
    trainer = LocalTrainer(_run(codec="int4"), peer_index=0)
    trainer.train(2)
    assert trainer.samples_since_sync() == 16
    first = trainer.take_contribution()
    assert first.samples == 16 and trainer.samples_since_sync() == 0
    assert torch.equal(first.delta, trainer.pseudo_gradient())  # nothing lost yet: Δ itself
    trainer.record_sent(first, "int4", parts=2)
    residual = trainer.error_feedback[0].residual
    assert residual.abs().max() > 0
    assert torch.equal(
        residual, first.delta - CODECS["int4"].decode(CODECS["int4"].encode(first.delta), first.delta.numel())
    )
    trainer.commit(trainer.apply(first.delta, None, 1))
    trainer.train(2)
    second = trainer.take_contribution()
    assert torch.equal(second.delta, trainer.pseudo_gradient() + residual)  # what was dropped goes out next
    trainer.record_sent(second, "fp32")  # a lossless round leaves nothing behind
    assert not trainer.error_feedback[0].residual.any()


def test_streaming_trainer_keeps_training_and_merges_one_fragment_with_the_mixing_factor():
    run = _run(inner_steps=4, fragments=2, overlap_steps=2, mixing_alpha=0.25)
    trainer = LocalTrainer(run, peer_index=0)
    assert trainer.streaming and trainer.num_fragments == 2
    frag0, frag1 = trainer.fragments
    trainer.train(2)
    contribution = trainer.take_contribution(0)
    assert (
        contribution.delta.numel() == trainer.fragment_numel(0) == sum(trainer.global_params[i].numel() for i in frag0)
    )
    trainer.train(2)  # the exchange is "in flight": training goes on, θl is not reset
    assert trainer.samples_since_sync(0) == 16 and trainer.samples_since_sync(1) == 32
    local = [p.detach().clone() for p in trainer.model.parameters()]
    old_global = [g.clone() for g in trainer.global_params]
    tentative = trainer.apply(contribution.delta, 0, 1)
    assert all(tentative.params[i] is trainer.global_params[i] for i in frag1)  # tentative, fragment 0 only
    trainer.commit(tentative, fragment=0)
    after = list(trainer.model.parameters())
    for i in frag0:
        ref = local[i].numpy() * np.float32(0.25) + tentative.params[i].numpy() * np.float32(0.75)
        assert torch.equal(after[i].detach(), torch.from_numpy(ref)), i
        assert not torch.equal(trainer.global_params[i], old_global[i])
    for i in frag1:
        assert torch.equal(after[i].detach(), local[i]) and torch.equal(trainer.global_params[i], old_global[i])
    trainer.commit(GlobalState(1, trainer.global_params, trainer.state.outer_state))  # a resync: θl ← θg everywhere
    assert all(torch.equal(p.detach(), g) for p, g in zip(trainer.model.parameters(), trainer.global_params))
    assert trainer.samples_since_sync(1) == 0


def test_streaming_simulation_syncs_fragments_in_turn_and_stays_consistent():
    run = _run(inner_steps=4, fragments=2, fragment_pattern="contiguous")
    result = simulate(run, peers=2, rounds=4)
    assert result.consistent and result.fragments == 2
    assert [r.fragment for r in result.rounds] == [0, 1, 0, 1]
    assert [r.steps for r in result.rounds] == [[2, 2]] * 4
    # Each peer sends its fragment's fp32 slices: the two fragments' sizes alternate, the sum is 2x all.
    trainer = LocalTrainer(run, peer_index=0)
    sizes = [4 * trainer.fragment_numel(f) for f in range(2)]
    assert [r.bytes_sent for r in result.rounds] == [[sizes[r % 2]] * 2 for r in range(4)]
    assert result.peak_bytes_per_sync == max(sizes) < 4 * result.param_count
    assert result.bytes_sent_per_peer == [2 * sum(sizes)] * 2


def test_int4_with_error_feedback_fragments_and_overlap_trains_and_stays_consistent():
    run = _run(inner_steps=10, codec="int4", fragments=2, overlap_steps=2)
    result = simulate(run, peers=2, rounds=4)
    assert result.consistent and result.error_feedback and result.codec == "int4"
    assert result.rounds[-1].eval_loss < result.initial_eval_loss - 1.5
    # Two members, slices aligned to int4 blocks: each sends exactly one encoding's worth of its fragment.
    trainer = LocalTrainer(run, peer_index=0)
    for r in result.rounds:
        assert r.bytes_sent == [CODECS["int4"].encoded_size(trainer.fragment_numel(r.fragment))] * 2
    assert result.peak_bytes_per_sync < 0.15 * 4 * result.param_count  # vs one full fp32 exchange


def test_error_feedback_changes_what_an_int4_swarm_computes():
    on = simulate(_run(inner_steps=3, codec="int4"), peers=2, rounds=2)
    off = simulate(_run(inner_steps=3, codec="int4"), peers=2, rounds=2, error_feedback=False)
    assert on.consistent and off.consistent and not off.error_feedback
    assert on.rounds[0].state_hash == off.rounds[0].state_hash  # nothing to feed back before round 2
    assert on.rounds[1].state_hash != off.rounds[1].state_hash


def test_a_third_speed_peer_does_a_third_of_the_steps_and_weighs_its_samples():
    run = _run(inner_steps=6)
    result = simulate(run, peers=2, rounds=1, speeds=[1.0, 1 / 3])
    assert result.rounds[0].steps == [6, 2] and result.rounds[0].samples == 8 * 8
    # The same round by hand: two trainers, Δ weighted by samples (48 and 16), one outer step.
    trainers = [LocalTrainer(run, peer_index=i) for i in range(2)]
    for t, steps in zip(trainers, (6, 2)):
        t.train(steps)
    avg = weighted_average([t.pseudo_gradient() for t in trainers], [48.0, 16.0])
    params = trainers[0].apply(avg, None, 1).params
    assert all(torch.equal(a, b) for a, b in zip(params, result.final_params))
    slow = simulate(run, peers=2, rounds=3, speeds=[1.0, 0.25])  # time budget: 1.5 steps a round
    assert [r.steps[1] for r in slow.rounds] == [1, 2, 1] and slow.consistent


def test_outer_optimizer_by_name_in_the_simulator_and_its_state_in_the_hash():
    run = RUN.replace(
        rounds=dataclasses.replace(RUN.rounds, inner_steps=3),
        outer=OuterOptConfig(name="AdamW", lr=0.01, options={"betas": [0.9, 0.95]}),
    )
    result = simulate(run, peers=2, rounds=2)
    assert result.consistent and result.outer == "AdamW"
    assert len(result.final_outer_state) == 4 * len(result.final_params)  # flag, exp_avg, exp_avg_sq, step
    assert state_hash(result.final_params, result.final_outer_state) == result.final_hash
    nesterov = simulate(RUN.replace(rounds=run.rounds), peers=2, rounds=2)
    assert nesterov.final_hash != result.final_hash
    trainer = LocalTrainer(run, peer_index=0)
    trainer.commit(GlobalState(2, result.final_params, result.final_outer_state))
    assert trainer.state.state_hash == result.final_hash
    state = list(trainer.state.outer_state)
    state[2] = state[2] + 1e-3  # only the optimizer's second moment changes
    trainer.commit(GlobalState(2, result.final_params, state))
    assert trainer.state.state_hash != result.final_hash


def test_torch_sgd_by_name_and_the_explicit_nesterov_step_agree_up_to_rounding():
    sgd = OuterOptConfig(name="SGD", lr=0.7, options={"momentum": 0.9, "nesterov": True})
    a = simulate(_run(inner_steps=3), peers=2, rounds=1)
    b = simulate(_run(inner_steps=3).replace(outer=sgd), peers=2, rounds=1)
    assert all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a.final_params, b.final_params))


def test_bad_streaming_and_speed_arguments_are_refused():
    with pytest.raises(ValueError, match="not both"):
        simulate(RUN, peers=2, rounds=1, steps_per_peer=[1, 1], speeds=[1.0, 1.0])
    with pytest.raises(ValueError, match="speed"):
        simulate(RUN, peers=2, rounds=1, speeds=[1.0, 0.01])
    with pytest.raises(ValueError, match="layer units"):
        simulate(RUN, peers=1, rounds=1, fragments=3)
    with pytest.raises(ValueError, match="nesterov"):
        simulate(RUN, peers=1, rounds=1, outer="Adamm")
