"""A progress line at most every 30 s while a round's inner steps run, none in a round that trains for less: driven
through the trainer's clock and the runner's budget with a fake clock, never by waiting."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from peer.report.progress import RoundProgress
from swarm.config import DataConfig, ModelConfig, RoundConfig, RunConfig

pytestmark = pytest.mark.timeout(60)


class FakeTrainer:
    """What the progress reads of a LocalTrainer: ``inner_steps_done``, ``clock`` after each step and once after each
    part (``train``), each step taking ``step_s`` of the fake clock."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s, self.inner_steps_done = 0.0, step_s, 0
        self.clock = lambda seconds: None

    def train(self, steps: int):
        for _ in range(steps):
            self.now += self.step_s
            self.inner_steps_done += 1
            self.clock(self.step_s)
        self.clock(0.0)
        return SimpleNamespace(steps=steps, mean_loss=4.2134)


def _round(progress: RoundProgress, trainer: FakeTrainer, round_no: int, steps: int) -> None:
    """As RoundRunner trains a round for a peer: its budget, then parts of 1/16 of the steps."""
    progress.planned(round_no, (0, steps))
    done = 0
    while done < steps:
        done += trainer.train(min(max(1, steps // 16), steps - done)).steps


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "peer.report.progress"]


def test_a_long_round_logs_its_progress_every_30_s_and_the_utilization_clock_still_hears_every_step(caplog):
    trainer, told = FakeTrainer(step_s=3.1), []
    progress = RoundProgress(trainer, tag=lambda r: f"[p-1 r{r}]", inner=told.append, now=lambda: trainer.now)
    progress.watch(trainer)
    with caplog.at_level(logging.INFO, logger="peer.report.progress"):
        _round(progress, trainer, 1, 50)  # 155 s
    assert _lines(caplog) == [f"[p-1 r1] training: step {n} of 50, 3.1 s/step, loss 4.21" for n in (10, 20, 30, 40, 50)]
    assert sum(told) == pytest.approx(155.0) and len(told) == 50 + 17  # each step, and once after each of 17 parts


def test_rounds_shorter_than_30_s_stay_quiet_and_each_round_counts_from_its_start(caplog):
    trainer = FakeTrainer(step_s=1.0)
    progress = RoundProgress(trainer, tag=lambda r: f"[p-1 r{r}]", now=lambda: trainer.now)
    progress.watch(trainer)
    with caplog.at_level(logging.INFO, logger="peer.report.progress"):
        for round_no in (1, 2, 3):
            _round(progress, trainer, round_no, 25)  # 25 s each, 75 s in all
            trainer.now += 20.0  # the exchange
        assert _lines(caplog) == []
        _round(progress, trainer, 4, 40)
    assert _lines(caplog) == ["[p-1 r4] training: step 30 of 40, 1.0 s/step, loss 4.21"]


def test_with_a_real_trainer_the_count_is_its_steps_not_its_clock_calls(caplog):
    from swarm.train.trainer import LocalTrainer

    run = RunConfig(
        model=ModelConfig(preset="bench"),
        rounds=RoundConfig(inner_steps=8),
        data=DataConfig(max_bytes=200_000, batch_size=2, seq_len=16, eval_batches=1),
    ).validate()
    trainer = LocalTrainer(run, peer_index=0, device="cpu")
    ticks = iter(range(0, 1000, 10))  # the fake clock: 10 s later at each look
    progress = RoundProgress(trainer, tag=lambda r: f"[p-1 r{r}]", now=lambda: next(ticks))
    progress.watch(trainer)
    with caplog.at_level(logging.INFO, logger="peer.report.progress"):
        progress.planned(1, (0, 8))  # t = 0: the first line is due at 30
        trainer.train(4)  # looks at 10, 20, 30 (a line at step 3), 40, and 50 after the part
        trainer.train(4)  # 60 (a line at step 5, with the first part's loss), 70, 80, 90 (step 8), 100
    lines = _lines(caplog)
    assert len(lines) == 3, lines
    assert re.fullmatch(r"\[p-1 r1\] training: step 3 of 8, (\d+ ms|\d+\.\d s)/step", lines[0])
    assert re.fullmatch(r"\[p-1 r1\] training: step 5 of 8, (\d+ ms|\d+\.\d s)/step, loss \d\.\d\d", lines[1])
    assert lines[2].startswith("[p-1 r1] training: step 8 of 8, ")
