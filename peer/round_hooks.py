"""What the peer does at the round runner's observation points: its numbers for the coordinator, its
log lines, fault injection, and the follow-up a decision needs (the group to go on with offline)."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.stats import PeerStats
from swarm.train.round import Hooks, Outcome, RoundResult, Vote
from swarm.train.trainer import TrainStats

logger = logging.getLogger(__name__)


class PeerHooks(Hooks):
    """Called on the main thread, except ``voted`` and ``at(.., 'averaged' | 'reported')`` (the executor),
    which touch only the thread-safe stats and the fault plan."""

    def __init__(self, stats: PeerStats, faults: FaultPlan, *, beat_now: Callable[[], None],
                 on_state: Callable[[str], None], on_decided: Callable[[RoundResult], None],
                 tag: Callable[[Optional[int]], str]) -> None:
        self.stats, self.faults, self.beat_now = stats, faults, beat_now
        self.on_state, self.on_decided, self.tag = on_state, on_decided, tag

    def at(self, round_no: int, phase: str) -> None:
        self.faults.at(round_no, phase)

    def trained(self, round_no: int, stats: TrainStats) -> None:
        tokens_per_s = stats.tokens / max(1e-9, stats.inner_time_s)
        self.stats.add(inner_time_s=stats.inner_time_s, inner_steps=stats.steps, tokens=stats.tokens)
        self.stats.update(loss=stats.mean_loss, step_time_s=stats.inner_time_s / max(1, stats.steps),
                          tokens_per_s=tokens_per_s)
        logger.info("%s trained %d steps, loss %.4f, %.0f tokens/s", self.tag(round_no), stats.steps,
                    stats.mean_loss, tokens_per_s)

    def exchanging(self, round_no: int) -> None:
        self.on_state("exchanging")
        self.beat_now()  # closes late admission to this round at the coordinator

    def deciding(self, round_no: int) -> None:
        self.on_state("deciding")

    def voted(self, vote: Vote) -> None:
        averaged = vote.averaged
        self.stats.add(bytes_sent=averaged.bytes_sent if averaged else 0,
                       bytes_received=averaged.bytes_received if averaged else 0,
                       contributions_rejected=averaged.contributions_rejected if averaged else 0,
                       contributions_clipped=averaged.contributions_clipped if averaged else 0,
                       foreign_messages_dropped=averaged.foreign_messages_dropped if averaged else 0)
        if averaged:
            self.stats.update(upload_mbit_s=averaged.upload_mbit_s, download_mbit_s=averaged.download_mbit_s,
                              rtt_ms=averaged.rtt_ms)
        if vote.ok:
            logger.info("%s tentative hash %s", self.tag(vote.round_no), vote.state_hash)
        else:
            logger.warning("%s exchange failed: %s", self.tag(vote.round_no), vote.error)

    def decided(self, result: RoundResult) -> None:
        if result.outcome is Outcome.VOIDED:
            logger.warning("%s voided by the %s; this round's work carries into the next", self.tag(result.round_no),
                           "group" if result.decision and result.decision.by_group else "coordinator")
        elif result.outcome is Outcome.COMMITTED:
            logger.info("%s committed, hash %s", self.tag(result.round_no), result.decision.committed_hash)
        elif result.outcome is Outcome.BEHIND:
            logger.info("%s committed %s, which this peer does not hold", self.tag(result.round_no),
                        result.decision.committed_hash)
        self.on_decided(result)

    def evaluated(self, round_no: int, loss: float) -> None:
        self.stats.update(eval_loss=loss, eval_round=round_no)
        logger.info("%s eval loss %.4f at round %d", self.tag(None), loss, round_no)
