"""A round's checkpoint is finished on a thread of its own while the peer trains on: what it holds is the trainer as
it was when the checkpoint was taken, a process killed meanwhile leaves a complete checkpoint, and one cut short
is written over by the next."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from peer.state.checkpoint import (
    CheckpointFinisher,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
    stage_checkpoint,
)
from peer.state.resume import checkpoint_spare, resume_trainer, stage_trainer
from swarm.config import DataConfig, RunConfig
from swarm.train.trainer import LocalTrainer

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _tensors(seed: int, n: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "inner.00000.exp_avg": torch.randn(n, generator=g),
        "local.00000": torch.randn(n, generator=g),
        "outer.00000": torch.randn(n, generator=g),
        "param.00000": torch.randn(n, generator=g),
    }


def _later(name: str) -> bool:
    return name.startswith(("param.", "outer."))


def test_a_staged_checkpoint_holds_its_tensors_as_staged_and_is_not_read_before_it_is_finished(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tensors=_tensors(0), manifest={"round": 1})
    tensors = _tensors(1)
    expected = {name: t.clone() for name, t in tensors.items()}
    staged = stage_checkpoint(tmp_path / "ckpt", tensors=tensors, manifest={"round": 2}, later=_later)
    tensors["local.00000"].add_(1.0)  # the next inner step: the staged file already holds θl as it was
    tensors["inner.00000.exp_avg"].mul_(0.5)
    _, manifest = load_checkpoint(tmp_path / "ckpt")
    assert manifest["round"] == 1  # a crash now resumes from the checkpoint before
    finisher = CheckpointFinisher(warn=pytest.fail)
    finisher.start(staged)
    finisher.wait()
    loaded, manifest = load_checkpoint(tmp_path / "ckpt")  # hash-checked
    assert manifest["round"] == 2
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_checkpoint_cut_short_is_written_over_and_the_replaced_file_is_kept_to_be_written_over(tmp_path):
    spare = tmp_path / "spare.safetensors"
    save_checkpoint(tmp_path / "ckpt", tensors=_tensors(0), manifest={"round": 1})
    stage_checkpoint(tmp_path / "ckpt", tensors=_tensors(1), manifest={"round": 2}, spare=spare)  # never finished
    assert read_manifest(tmp_path / "ckpt")["round"] == 1
    for round_no in (3, 4):
        stage_checkpoint(
            tmp_path / "ckpt", tensors=_tensors(round_no), manifest={"round": round_no}, spare=spare
        ).finish()
        loaded, manifest = load_checkpoint(tmp_path / "ckpt")
        assert manifest["round"] == round_no
        assert all(torch.equal(loaded[k], v) for k, v in _tensors(round_no).items())
        assert spare.exists()  # the replaced checkpoint's file, for the next one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "spare.safetensors"]


def test_a_superseded_checkpoint_is_given_up_and_the_one_before_stays(tmp_path):
    save_checkpoint(tmp_path / "ckpt", tensors=_tensors(0), manifest={"round": 1})
    staged = stage_checkpoint(tmp_path / "ckpt", tensors=_tensors(1), manifest={"round": 2})
    assert staged.finish(cancelled=lambda: True) is False
    assert read_manifest(tmp_path / "ckpt")["round"] == 1
    save_checkpoint(tmp_path / "ckpt", tensors=_tensors(2), manifest={"round": 3})
    assert load_checkpoint(tmp_path / "ckpt")[1]["round"] == 3


def _run() -> RunConfig:
    run = RunConfig(data=DataConfig(max_bytes=400_000))
    return run.replace(rounds=dataclasses.replace(run.rounds, inner_steps=4, codec="int8"))


def _one_round(trainer: LocalTrainer, round_no: int) -> None:
    trainer.train(4)
    contribution = trainer.take_contribution(0)
    trainer.record_sent(contribution, trainer.run.rounds.codec)
    trainer.commit(trainer.apply(contribution.delta * 0.5, 0, round_no))


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("steps_after_commit", [0, 1])
def test_a_checkpoint_finished_while_the_peer_trains_on_resumes_bit_for_bit_where_it_was_taken(
    tmp_path, steps_after_commit
):
    original, twin = LocalTrainer(_run(), peer_index=1), LocalTrainer(_run(), peer_index=1)
    for trainer in (original, twin):
        for r in (1, 2):
            _one_round(trainer, r)
        if steps_after_commit:
            trainer.train(steps_after_commit)
    staged = stage_trainer(
        tmp_path / "checkpoint", original, run_id="run-x", spare=checkpoint_spare(tmp_path), global_later=True
    )
    finisher = CheckpointFinisher(warn=pytest.fail)
    finisher.start(staged)
    original.train(2)  # θl, AdamW and the data position move on while θg and the outer state are written
    finisher.wait()  # before the next commit changes θg

    loaded, manifest = load_checkpoint(tmp_path / "checkpoint")
    # right after a commit θl is θg's bits: the checkpoint holds them once
    assert manifest["local_is_global"] is (steps_after_commit == 0)
    assert any(name.startswith("local.") for name in loaded) is (steps_after_commit > 0)
    del loaded

    resumed = LocalTrainer(_run(), peer_index=1)
    assert resume_trainer(
        tmp_path / "checkpoint", resumed, run_id="run-x", round_no=2, state_hash=twin.state.state_hash
    )
    for p, q in zip(twin.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    a, b = twin.train(2), resumed.train(2)
    assert a.mean_loss == b.mean_loss
    ca, cb = twin.take_contribution(0), resumed.take_contribution(0)
    assert torch.equal(ca.delta, cb.delta) and ca.samples == cb.samples


CHILD = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from peer.state.checkpoint import CheckpointFinisher, save_checkpoint, stage_checkpoint
    directory = Path(sys.argv[1])
    n = 16 << 20  # 4 tensors of 64 MiB
    tensors = {name: torch.full((n,), float(i)) for i, name in enumerate(["inner.0", "local.0", "outer.0", "param.0"])}
    save_checkpoint(directory, tensors=tensors, manifest={"round": 1})
    for t in tensors.values():
        t.add_(1.0)
    staged = stage_checkpoint(directory, tensors=tensors, manifest={"round": 2}, later=lambda name: name[:6] in ("outer.", "param."))
    finisher = CheckpointFinisher(warn=print)
    print("finishing", flush=True)
    finisher.start(staged)
    finisher.wait()
    print("finished", flush=True)
    """
)


@pytest.mark.slow
def test_a_peer_killed_while_its_checkpoint_is_finished_restarts_from_a_complete_checkpoint(tmp_path):
    directory = tmp_path / "checkpoint"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert child.stdout.readline().strip() == "finishing"
        child.send_signal(signal.SIGKILL)  # while θg is written, hashed or fsynced, or just after
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    loaded, manifest = load_checkpoint(directory)  # complete: its size and SHA-256 match its manifest
    offset = manifest["round"] - 1  # round 1 (the one before) or round 2 (the new one), never a mix
    assert manifest["round"] in (1, 2)
    for i, name in enumerate(["inner.0", "local.0", "outer.0", "param.0"]):
        assert torch.all(loaded[name] == float(i + offset)), name
