"""What the peer does at the round runner's observation points: its numbers for the coordinator, its
log lines, fault injection, and the follow-up a decision needs (the group to go on with offline)."""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.report.round_log import RoundLog
from peer.report.stats import PeerStats
from swarm.train.contribution import TrainStats
from swarm.train.round import Hooks, RoundResult, Vote
from swarm.train.train_log import TrainLog

logger = logging.getLogger(__name__)


class PeerHooks(Hooks):
    """Called on the main thread, except ``voted`` and ``at(.., 'averaged' | 'reported')`` (the executor),
    which touch only the thread-safe stats, round log and fault plan."""

    def __init__(
        self,
        stats: PeerStats,
        faults: FaultPlan,
        *,
        beat_now: Callable[[], None],
        on_state: Callable[[str], None],
        on_decided: Callable[[RoundResult], None],
        tag: Callable[[Optional[int]], str],
        lr: Callable[[], float] = lambda: math.nan,
        log: Optional[RoundLog] = None,
    ) -> None:
        """``lr``: the inner lr last used; ``log``: the round's line and training-log scalars."""
        self.stats, self.faults, self.beat_now = stats, faults, beat_now
        self.on_state, self.on_decided, self.tag, self.lr = on_state, on_decided, tag, lr
        self.log = log or RoundLog(TrainLog([]), tag=tag)

    def at(self, round_no: int, phase: str) -> None:
        self.faults.at(round_no, phase)

    def trained(self, round_no: int, stats: TrainStats) -> None:
        tokens_per_s = stats.tokens / max(1e-9, stats.inner_time_s)
        self.stats.add(inner_steps=stats.steps, tokens=stats.tokens)  # inner_time_s: live, from the trainer's clock
        self.stats.update(
            loss=stats.mean_loss,
            step_time_s=stats.inner_time_s / max(1, stats.steps),
            step_time_probed=False,
            tokens_per_s=tokens_per_s,
        )
        self.log.trained(round_no, stats, lr=self.lr())

    def exchanging(self, round_no: int) -> None:
        self.on_state("exchanging")
        self.beat_now()  # closes late admission to this round at the coordinator

    def deciding(self, round_no: int) -> None:
        self.on_state("deciding")

    def voted(self, vote: Vote) -> None:
        averaged = vote.averaged
        self.stats.add(
            bytes_sent=averaged.bytes_sent if averaged else 0,
            bytes_received=averaged.bytes_received if averaged else 0,
            contributions_rejected=averaged.contributions_rejected if averaged else 0,
            contributions_clipped=averaged.contributions_clipped if averaged else 0,
            foreign_messages_dropped=averaged.foreign_messages_dropped if averaged else 0,
        )
        if averaged:
            self.stats.update(
                upload_mbit_s=averaged.upload_mbit_s, download_mbit_s=averaged.download_mbit_s, rtt_ms=averaged.rtt_ms
            )
        logger.debug("%s tentative hash %s", self.tag(vote.round_no), vote.state_hash or "none")
        self.log.voted(vote)

    def decided(self, result: RoundResult) -> None:
        self.log.decided(result)  # the round's one line
        self.on_decided(result)

    def evaluated(self, round_no: int, loss: float) -> None:
        self.stats.update(eval_loss=loss, eval_round=round_no)
        self.log.evaluated(round_no, loss)

    def close(self) -> None:
        self.log.close()
