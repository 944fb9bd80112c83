"""A peer's checkpoint restores its whole training state: the resumed peer continues bit for bit."""

import dataclasses

import pytest
import torch

from peer.state.resume import maybe_resume, resume_trainer, save_trainer
from peer.state.votes import prune_votes, save_vote, vote_dir
from swarm.config import DataConfig, RunConfig
from swarm.core.state import GlobalState
from swarm.train.trainer import LocalTrainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _run(codec: str = "int8") -> RunConfig:
    run = RunConfig(data=DataConfig(max_bytes=400_000))
    return run.replace(rounds=dataclasses.replace(run.rounds, inner_steps=4, codec=codec))


def _one_round(trainer: LocalTrainer, round_no: int) -> None:
    trainer.train(4)
    contribution = trainer.take_contribution(0)
    trainer.record_sent(contribution, trainer.run.rounds.codec)
    trainer.commit(trainer.apply(contribution.delta * 0.5, 0, round_no))


def test_resumed_trainer_continues_exactly_like_the_uninterrupted_one(tmp_path):
    original = LocalTrainer(_run(), peer_index=1)
    for r in (1, 2):
        _one_round(original, r)
    original.train(3)  # mid-round local progress is checkpointed too
    save_trainer(tmp_path / "ckpt", original, run_id="run-x")

    resumed = LocalTrainer(_run(), peer_index=1)
    assert resume_trainer(tmp_path / "ckpt", resumed, run_id="run-x", round_no=2, state_hash=original.state.state_hash)
    assert resumed.state.state_hash == original.state.state_hash
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
    save_trainer(tmp_path / "ckpt", trainer, run_id="run-x")
    fresh = LocalTrainer(_run(), peer_index=0)
    assert not resume_trainer(tmp_path / "ckpt", fresh, run_id="run-x", round_no=2, state_hash="0" * 16)
    assert not resume_trainer(tmp_path / "ckpt", fresh, run_id="run-y", round_no=1, state_hash=trainer.state.state_hash)
    assert fresh.round_no == 0
    assert not resume_trainer(
        tmp_path / "missing", fresh, run_id="run-x", round_no=1, state_hash=trainer.state.state_hash
    )


def test_a_peer_killed_before_hearing_the_decision_resumes_from_its_vote(tmp_path):
    original = LocalTrainer(_run(), peer_index=1)
    _one_round(original, 1)
    save_trainer(tmp_path / "checkpoint", original, run_id="run-x")
    original.train(4)  # round 2: averaged, voted, then killed before the coordinator's decision arrived
    contribution = original.take_contribution(0)
    tentative = original.apply(contribution.delta * 0.5, 0, 2)
    voted = tentative.state_hash
    save_vote(tmp_path, tentative, run_id="run-x")

    restarted = LocalTrainer(_run(), peer_index=1)
    assert maybe_resume(tmp_path, restarted, run_id="run-x", round_no=2, state_hash=voted) == 2
    assert restarted.round_no == 2 and restarted.state.state_hash == voted
    # the inner AdamW state came from the round-1 checkpoint: it is not a fresh optimizer
    assert restarted.optimizer.state_dict()["state"], "inner optimizer state was not restored"
    assert all(not f.residual.any() for f in restarted.error_feedback or []), "the residual was already sent"


def test_a_vote_that_was_not_committed_or_is_damaged_is_not_used(tmp_path, caplog):
    trainer = LocalTrainer(_run(), peer_index=0)
    trainer.train(4)
    tentative = trainer.apply(trainer.take_contribution(0).delta, 0, 1)
    voted = tentative.state_hash
    save_vote(tmp_path, tentative, run_id="run-x")
    fresh = LocalTrainer(_run(), peer_index=0)
    assert maybe_resume(tmp_path, fresh, run_id="run-x", round_no=1, state_hash="0" * 16) is None  # another hash won
    assert maybe_resume(tmp_path, fresh, run_id="run-x", round_no=2, state_hash=voted) is None
    assert fresh.round_no == 0
    blob = vote_dir(tmp_path, 1) / "state.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert maybe_resume(tmp_path, fresh, run_id="run-x", round_no=1, state_hash=voted) is None
    assert fresh.round_no == 0
    assert "corrupted" in caplog.text


def test_votes_are_kept_until_the_coordinator_commits_a_later_round(tmp_path):
    trainer = LocalTrainer(_run(), peer_index=0)
    for r in (3, 4, 5, 6):  # 3 committed by the coordinator; 4-6 decided by the group while it was down
        save_vote(tmp_path, GlobalState(r, trainer.global_params, trainer.state.outer_state), run_id="run-x")
    prune_votes(tmp_path, below=3)
    assert [r for r in range(3, 7) if vote_dir(tmp_path, r).exists()] == [3, 4, 5, 6]
    # the coordinator came back and voided 4: round 3 must still be there to resume from
    state_hash = trainer.state.state_hash  # the hash does not cover the round number
    assert (
        maybe_resume(tmp_path, LocalTrainer(_run(), peer_index=0), run_id="run-x", round_no=3, state_hash=state_hash)
        == 3
    )
    prune_votes(tmp_path, below=6)
    assert [r for r in range(3, 7) if vote_dir(tmp_path, r).exists()] == [6]


def test_a_checkpoint_of_an_older_format_is_refused_with_a_message(tmp_path, caplog):
    import json

    trainer = LocalTrainer(_run(), peer_index=0)
    _one_round(trainer, 1)
    save_trainer(tmp_path / "ckpt", trainer, run_id="run-x")
    manifest = tmp_path / "ckpt" / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), format_version=1)))
    fresh = LocalTrainer(_run(), peer_index=0)
    assert not resume_trainer(tmp_path / "ckpt", fresh, run_id="run-x", round_no=1, state_hash=trainer.state.state_hash)
    assert "written by another version of Swarm" in caplog.text and fresh.round_no == 0


def test_a_tentative_states_vote_is_stepped_once_as_it_is_written_and_is_the_materialised_states(tmp_path):
    from peer.state.checkpoint import TENSORS
    from swarm.core.tentative import TentativeState

    trainer = LocalTrainer(_run(), peer_index=0)
    trainer.train(4)
    tentative = trainer.apply(trainer.take_contribution(0).delta, 0, 1)
    assert isinstance(tentative, TentativeState)
    materialised = GlobalState(1, tentative.params, tentative.outer_state)
    steps: list[int] = []
    real_step = tentative._step_into

    def counting(p, *args):
        steps.append(p.numel())
        return real_step(p, *args)

    tentative._step_into = counting  # each piece stepped once, for θg' and the momentum together, hash included
    save_vote(tmp_path / "lazy", tentative, run_id="run-x")
    assert sum(steps) == sum(p.numel() for p in trainer.state.params)
    assert "state_hash" in tentative.__dict__ and tentative.state_hash == materialised.state_hash
    save_vote(tmp_path / "whole", materialised, run_id="run-x")
    lazy, whole = (vote_dir(tmp_path / d, 1) / TENSORS for d in ("lazy", "whole"))
    assert lazy.read_bytes() == whole.read_bytes()
    restarted = LocalTrainer(_run(), peer_index=0)
    assert (
        maybe_resume(tmp_path / "lazy", restarted, run_id="run-x", round_no=1, state_hash=materialised.state_hash) == 1
    )


def test_a_restarted_peer_builds_from_its_vote_without_drawing_theta0_and_trains_on_like_a_resumed_one(
    tmp_path, monkeypatch
):
    from peer.state.resume import start_trainer, step_time_record
    from swarm.train.model import model as model_module

    original = LocalTrainer(_run(), peer_index=1)
    _one_round(original, 1)
    save_trainer(tmp_path / "checkpoint", original, run_id="run-x")
    original.train(4)
    tentative = original.apply(original.take_contribution(0).delta * 0.5, 0, 2)
    voted = tentative.state_hash
    save_vote(tmp_path, tentative, run_id="run-x", step_time=step_time_record(original))
    resumed_old_way = LocalTrainer(_run(), peer_index=1)
    assert maybe_resume(tmp_path, resumed_old_way, run_id="run-x", round_no=2, state_hash=voted) == 2

    def no_draws(*args, **kwargs):
        raise AssertionError("θ0 was drawn")

    monkeypatch.setattr(model_module, "portable_normal", no_draws)
    started = start_trainer(_run(), tmp_path, run_id="run-x", round_no=2, state_hash=voted, peer_index=1, device="cpu")
    restarted = started.trainer
    assert started.resumed is not None and started.resumed.source == "vote"
    assert restarted.round_no == 2 and restarted.state.state_hash == voted
    assert started.known_step_time() == original.local_step_time_s  # no probe: the step time it measured
    assert restarted.optimizer.state_dict()["state"], "inner optimizer state was not restored"
    a, b = resumed_old_way.train(2), restarted.train(2)
    assert a.mean_loss == b.mean_loss
    for p, q in zip(resumed_old_way.model.parameters(), restarted.model.parameters()):
        assert torch.equal(p, q)


def test_a_peer_without_the_committed_state_on_its_disk_starts_from_theta0(tmp_path):
    from peer.state.resume import start_trainer

    trainer = LocalTrainer(_run(), peer_index=0)
    _one_round(trainer, 1)
    save_trainer(tmp_path / "checkpoint", trainer, run_id="run-x")
    fresh = LocalTrainer(_run(), peer_index=0)
    for run_id, round_no in (("run-y", 1), ("run-x", 2)):  # another run's, or an older round than the committed one
        started = start_trainer(
            _run(), tmp_path, run_id=run_id, round_no=round_no, state_hash="0" * 16, peer_index=0, device="cpu"
        )
        assert started.resumed is None and started.known_step_time() is None
        assert started.trainer.round_no == 0 and started.trainer.state.state_hash == fresh.state.state_hash
    # its own checkpoint: θl and AdamW exactly as they were
    started = start_trainer(
        _run(), tmp_path, run_id="run-x", round_no=1, state_hash=trainer.state.state_hash, peer_index=0, device="cpu"
    )
    assert started.resumed is not None and started.resumed.source == "checkpoint"
    for p, q in zip(trainer.model.parameters(), started.trainer.model.parameters()):
        assert torch.equal(p, q)


def test_a_streaming_fragments_vote_written_in_one_pass_is_the_materialised_states(tmp_path):
    from peer.state.checkpoint import TENSORS

    base = _run()
    run = base.replace(rounds=dataclasses.replace(base.rounds, fragments=2, fragment_pattern="balanced"))
    trainer = LocalTrainer(run, peer_index=0)
    trainer.train(4)
    tentative = trainer.apply(trainer.take_contribution(1).delta, 1, 1)  # spans that cut tensors in parts
    materialised = GlobalState(1, tentative.params, tentative.outer_state)
    save_vote(tmp_path / "lazy", tentative, run_id="run-x")
    save_vote(tmp_path / "whole", materialised, run_id="run-x")
    assert tentative.state_hash == materialised.state_hash
    lazy, whole = (vote_dir(tmp_path / d, 1) / TENSORS for d in ("lazy", "whole"))
    assert lazy.read_bytes() == whole.read_bytes()
