"""A peer's checkpoint restores its whole training state: the resumed peer continues bit for bit."""

import dataclasses

import pytest
import torch

from peer.resume import resume_trainer, save_trainer
from swarm.config import DataConfig, RunConfig
from swarm.trainer import LocalTrainer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]




def _run(codec: str = "int8") -> RunConfig:
    run = RunConfig(data=DataConfig(max_bytes=400_000))
    return run.replace(rounds=dataclasses.replace(run.rounds, inner_steps=4, codec=codec))


def _one_round(trainer: LocalTrainer, round_: int) -> None:
    trainer.train(4)
    contribution = trainer.take_contribution(0)
    trainer.record_sent(contribution, trainer.run.rounds.codec)
    params, state = trainer.apply(contribution.delta * 0.5)
    trainer.commit(params, state, round_)


def test_resumed_trainer_continues_exactly_like_the_uninterrupted_one(tmp_path):
    original = LocalTrainer(_run(), peer_index=1)
    for r in (1, 2):
        _one_round(original, r)
    original.train(3)  # mid-round local progress is checkpointed too
    save_trainer(tmp_path / "ckpt", original, run_id="run-x", state_hash=original.state_hash())

    resumed = LocalTrainer(_run(), peer_index=1)
    assert resume_trainer(tmp_path / "ckpt", resumed, run_id="run-x", round_=2, state_hash=original.state_hash())
    assert resumed.state_hash() == original.state_hash()
    a, b = original.train(2), resumed.train(2)
    assert a.mean_loss == b.mean_loss
    for p, q in zip(original.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    ca, cb = original.take_contribution(0), resumed.take_contribution(0)
    assert torch.equal(ca.delta, cb.delta), "error feedback residual or local state differs"
    assert ca.samples == cb.samples


def test_a_stale_or_foreign_checkpoint_is_not_used(tmp_path):
    trainer = LocalTrainer(_run(), peer_index=0)
    _one_round(trainer, 1)
    save_trainer(tmp_path / "ckpt", trainer, run_id="run-x", state_hash=trainer.state_hash())
    fresh = LocalTrainer(_run(), peer_index=0)
    assert not resume_trainer(tmp_path / "ckpt", fresh, run_id="run-x", round_=2, state_hash="0" * 16)
    assert not resume_trainer(tmp_path / "ckpt", fresh, run_id="run-y", round_=1, state_hash=trainer.state_hash())
    assert fresh.round == 0
    assert not resume_trainer(tmp_path / "missing", fresh, run_id="run-x", round_=1, state_hash=trainer.state_hash())
