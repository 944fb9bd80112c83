"""A progress line while a long round's inner steps run: at a real model size a first round trained for a minute
without a word. At most one line every 30 s, and none in a round that trains for less than that:

    [p-3f… r1] training: step 12 of 50, 3.1 s/step, loss 4.21

It hooks into what the trainer and the round runner already call: the trainer's ``clock`` (after each inner step,
with its seconds), the runner's ``budget`` (a round's steps, asked as the round starts) and ``train`` (a part of the
round's steps: the runner trains them in parts of 1/16, whose mean loss the line shows)."""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0


class RoundProgress:
    def __init__(
        self,
        trainer,
        *,
        tag: Callable[[int], str],
        inner: Callable[[float], None] = lambda seconds: None,
        every_s: Optional[float] = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        """``trainer``: its ``inner_steps_done`` counts the steps; ``inner``: what its clock told before (the peer's
        live utilization); ``tag(round_no)``: the line's prefix; ``every_s``: PROGRESS_EVERY_S unless given."""
        self._trainer, self._tag, self._inner, self._now = trainer, tag, inner, now
        self._every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self._round: Optional[int] = None
        self._steps = 0  # the round's planned inner steps
        self._first_step = 0  # trainer.inner_steps_done as the round started
        self._seconds = 0.0  # inner seconds of the round so far
        self._loss = math.nan  # mean loss of the round's last part
        self._due = math.inf  # when the next line may be written
        self._logged = 0  # the step the last line named

    def watch(self, trainer) -> None:
        """Take over ``trainer.clock`` and note the loss of each part ``trainer.train`` trains (its result unchanged)."""
        train = trainer.train

        def train_noting_loss(steps: int):
            stats = train(steps)
            if stats.steps:
                self._loss = stats.mean_loss
            return stats

        trainer.train = train_noting_loss
        trainer.clock = self.clock

    def planned(self, round_no: int, budget: tuple[int, int]) -> tuple[int, int]:
        """The runner's budget for ``round_no``, passed through: the first ask starts the round's count; a later
        one (once a carried round is finished) may change its steps."""
        if round_no != self._round:
            self._round, self._first_step = round_no, self._trainer.inner_steps_done
            self._seconds, self._loss, self._due, self._logged = 0.0, math.nan, self._now() + self._every_s, 0
        self._steps = budget[1]
        return budget

    def clock(self, seconds: float) -> None:
        """The trainer's clock: after each inner step (and once after each part), with the seconds it took."""
        self._inner(seconds)
        if self._round is None:
            return
        self._seconds += seconds
        now = self._now()
        if now < self._due:
            return
        done = self._trainer.inner_steps_done - self._first_step
        if done <= self._logged:  # no step since the last line (the clock's call after a part)
            return
        self._due, self._logged = now + self._every_s, done
        per_step = self._seconds / done
        pace = f"{per_step:.1f} s/step" if per_step >= 1 else f"{per_step * 1000:.0f} ms/step"
        loss = "" if math.isnan(self._loss) else f", loss {self._loss:.2f}"
        logger.info(
            "%s training: step %d of %d, %s%s", self._tag(self._round), done, max(done, self._steps), pace, loss
        )
