"""The inner loop's [inner] options: precision, micro-batches, the lr schedule, prefetching, compile."""

import dataclasses
import math

import pytest
import torch

from swarm.config import ConfigError, DataConfig, InnerOptConfig, ModelConfig, RoundConfig, RunConfig
from swarm.train import inner_step
from swarm.train.data import prefetch
from swarm.train.schedule import lr_at
from swarm.train.simulator.sim import simulate
from swarm.train.trainer import LocalTrainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

RUN = RunConfig(
    seed=0,
    model=ModelConfig(preset="tiny"),
    data=DataConfig(max_bytes=300_000, num_shards=2, batch_size=8, seq_len=32, eval_batches=1),
    inner=InnerOptConfig(warmup_steps=2),
    rounds=RoundConfig(inner_steps=3),
).validate()


def _with_inner(run: RunConfig, **inner) -> RunConfig:
    return run.replace(inner=dataclasses.replace(run.inner, **inner)).validate()


def test_bf16_peers_train_and_keep_the_global_state_fp32_and_identical():
    fp32 = simulate(RUN, peers=2, rounds=1)
    bf16 = simulate(_with_inner(RUN, precision="bf16"), peers=2, rounds=1)
    assert bf16.consistent and all(len(set(r.peer_hashes)) == 1 for r in bf16.rounds)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in bf16.final_params)
    assert bf16.final_hash != fp32.final_hash  # bf16 compute really ran
    assert bf16.final_eval_loss < bf16.initial_eval_loss - 0.5
    assert abs(bf16.final_eval_loss - fp32.final_eval_loss) < 0.05


def test_fp16_trains_with_a_gradient_scaler():
    trainer = LocalTrainer(_with_inner(RUN, precision="fp16"), peer_index=0)
    assert trainer.inner_step.scaler is not None
    stats = trainer.train(4)
    assert math.isfinite(stats.mean_loss)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert trainer.pseudo_gradient().abs().sum() > 0


def test_two_micro_batches_take_the_same_step_as_one_batch():
    one = LocalTrainer(RUN, peer_index=0)
    two = LocalTrainer(_with_inner(RUN, micro_batches=2), peer_index=0)
    a, b = one.train(3), two.train(3)
    assert (a.samples, a.tokens) == (b.samples, b.tokens) == (24, 24 * 32)
    assert abs(a.mean_loss - b.mean_loss) < 1e-5
    for p, q in zip(one.model.parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert not all(torch.equal(p, q) for p, q in zip(one.model.parameters(), two.model.parameters()))


def test_schedules_warm_up_then_decay_over_the_run():
    cfg = InnerOptConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(cfg, peer_step=0, run_step=0, run_steps=100) == pytest.approx(0.1)
    assert lr_at(cfg, peer_step=9, run_step=9, run_steps=100) == pytest.approx(math.cos(math.pi * 0.09) * 0.45 + 0.55)
    assert lr_at(cfg, peer_step=50, run_step=50, run_steps=100) == pytest.approx(0.55)
    assert lr_at(cfg, peer_step=100, run_step=100, run_steps=100) == pytest.approx(0.1)
    assert lr_at(cfg, peer_step=500, run_step=150, run_steps=100) == pytest.approx(0.1)  # a voided round's extra steps
    linear = dataclasses.replace(cfg, schedule="linear")
    assert lr_at(linear, peer_step=75, run_step=75, run_steps=100) == pytest.approx(0.1 + 0.9 * 0.25)
    constant = dataclasses.replace(cfg, schedule="constant")
    assert lr_at(constant, peer_step=75, run_step=75, run_steps=100) == 1.0
    # a peer joining late warms up its fresh AdamW state, at the run's decayed rate
    assert lr_at(cfg, peer_step=4, run_step=50, run_steps=100) == pytest.approx(0.5 * 0.55)


def test_the_trainer_follows_the_run_position_and_a_resumed_peer_gets_the_same_rate():
    run = RUN.replace(
        inner=dataclasses.replace(RUN.inner, schedule="linear", warmup_steps=0, min_lr_ratio=0.0),
        rounds=dataclasses.replace(RUN.rounds, max_rounds=4),
    ).validate()
    trainer = LocalTrainer(run, peer_index=0)
    assert trainer.run_inner_steps == 12
    trainer.train(3)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(run.inner.lr * (1 - 2 / 12))
    trainer.commit(trainer.apply(trainer.pseudo_gradient(), None, 1), fragment=0)
    assert trainer.run_step == 3
    resumed = LocalTrainer(run, peer_index=0)
    resumed.commit(trainer.state)
    assert resumed.run_step == trainer.run_step
    assert resumed.lr_at(7, resumed.run_step) == trainer.lr_at(7, trainer.run_step)


def test_prefetching_draws_the_same_batches_in_the_same_order():
    plain, ahead = LocalTrainer(RUN, peer_index=1).sampler, LocalTrainer(RUN, peer_index=1).sampler
    expected = [plain.next_batch() for _ in range(5)]
    got = list(prefetch.batches(ahead.next_batch, 5, torch.device("cpu"), prefetch=True))
    assert all(torch.equal(x, a) and torch.equal(y, b) for (x, y), (a, b) in zip(got, expected))
    assert ahead.batches_drawn == plain.batches_drawn == 5  # a checkpoint resumes at the same batch
    early = prefetch.batches(ahead.next_batch, 4, torch.device("cpu"))
    next(early)
    early.close()  # stopped after one: the thread still finishes exactly what it was asked for
    assert ahead.batches_drawn == 9


def test_bad_inner_settings_get_one_sentence():
    with pytest.raises(ConfigError, match="precision 'fp8' is unknown"):
        _with_inner(RUN, precision="fp8")
    with pytest.raises(ConfigError, match="must divide"):
        _with_inner(RUN, micro_batches=3)
    with pytest.raises(ConfigError, match="set \\[rounds\\] max_rounds"):
        _with_inner(RUN, schedule="cosine")


def test_compile_without_a_compiler_trains_eagerly_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(inner_step.shutil, "which", lambda name: None)
    trainer = LocalTrainer(_with_inner(RUN, compile=True), peer_index=0)
    assert not trainer.inner_step.compiled
    assert "no C++ compiler" in caplog.text
    assert math.isfinite(trainer.train(1).mean_loss)
