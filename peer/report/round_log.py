"""A peer's account of each round: one readable log line once the round is decided, and the round's scalars for
TensorBoard / W&B ([logging] in the run config): inner loss, lr, tokens/s, step time, bytes, link figures.

The round runner hands its figures over in pieces (trained on the main thread, voted on the exchange's
thread, decided on the main thread again); they are kept per round until its decision.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from swarm.config import RunConfig
from swarm.train.contribution import TrainStats
from swarm.train.round import Outcome, RoundResult, Vote
from swarm.train.train_log import TrainLog, open_train_log

logger = logging.getLogger("peer.round_hooks")  # the peer's round lines, where operators already look for them

KEPT_ROUNDS = 8  # rounds whose figures wait for a decision (one in flight with overlap; a few when offline)


@dataclass
class _Round:
    train: Optional[TrainStats] = None
    lr: float = math.nan
    vote: Optional[Vote] = None
    eval_loss: Optional[float] = None  # the runner evaluates a committed state before it reports the decision


class RoundLog:
    """Thread-safe: ``_rounds`` is touched only under ``_lock``."""

    def __init__(self, train_log: TrainLog, *, tag: Callable[[Optional[int]], str]) -> None:
        self.train_log, self.tag = train_log, tag
        self._lock = threading.Lock()
        self._rounds: dict[int, _Round] = {}

    @classmethod
    def for_run(cls, run: RunConfig, *, name: str, run_id: str, tag: Callable[[Optional[int]], str]) -> "RoundLog":
        """The log of a peer called ``name`` (its --name, or its id) in run ``run_id``, writing what [logging] asks."""
        train_log = open_train_log(run.logging, name=name, group=run_id, run_config=run.to_dict())
        return cls(train_log, tag=tag)

    def trained(self, round_no: int, stats: TrainStats, *, lr: float) -> None:
        with self._lock:
            entry = self._entry(round_no)
            entry.train, entry.lr = stats, lr

    def voted(self, vote: Vote) -> None:
        with self._lock:
            self._entry(vote.round_no).vote = vote

    def decided(self, result: RoundResult) -> None:
        with self._lock:
            entry = self._rounds.pop(result.round_no, _Round())
        train = entry.train or (entry.vote.train if entry.vote else None)
        level = logging.WARNING if result.outcome is Outcome.VOIDED else logging.INFO
        evaluated = "" if entry.eval_loss is None else f"; eval loss {entry.eval_loss:.4f}"
        waited = f"; training waited {result.waited_s:.2f} s for it" if result.waited_s >= 0.05 else ""
        local = f"; local work {result.overhead_s:.2f} s" if result.overhead_s >= 0.05 else ""  # Δ, step, vote, commit
        logger.log(
            level,
            "%s %s: %s%s%s%s",
            self.tag(result.round_no),
            outcome_words(result),
            figures(train, entry.vote),
            waited,
            local,
            evaluated,
        )
        self.train_log.log(result.round_no, round_scalars(result, train, entry.lr, entry.vote))

    def evaluated(self, round_no: int, loss: float) -> None:
        """A round's evaluation joins its decision's line; another (the initial state's) gets its own."""
        with self._lock:
            entry = self._rounds.get(round_no)
            if entry is not None:
                entry.eval_loss = loss
        if entry is None:
            logger.info("%s eval loss %.4f at round %d", self.tag(None), loss, round_no)
        self.train_log.log(round_no, {"eval/loss": loss})

    def close(self) -> None:
        self.train_log.close()

    def _entry(self, round_no: int) -> _Round:
        while round_no not in self._rounds and len(self._rounds) >= KEPT_ROUNDS:
            del self._rounds[min(self._rounds)]  # a round that ended without a decision (stopped, left out)
        return self._rounds.setdefault(round_no, _Round())


def outcome_words(result: RoundResult) -> str:
    decision = result.decision
    if result.outcome is Outcome.COMMITTED:
        return f"committed, hash {decision.committed_hash}"
    if result.outcome is Outcome.VOIDED:
        by = "group" if decision and decision.by_group else "coordinator"
        return f"voided by the {by} (this round's work carries into the next)"
    if result.outcome is Outcome.BEHIND:
        return f"committed {decision.committed_hash}, which this peer does not hold"
    return result.outcome.name.lower().replace("_", " ")


def figures(train: Optional[TrainStats], vote: Optional[Vote]) -> str:
    """steps, loss, tokens/s, bytes, exchange seconds and the round plan's codec, as a person reads them."""
    parts = []
    if train is not None:
        parts.append(
            f"{train.steps} steps, loss {train.mean_loss:.4f}, "
            f"{train.tokens / max(1e-9, train.inner_time_s):,.0f} tokens/s"
        )
    averaged = vote.averaged if vote is not None else None
    if averaged is not None:
        parts.append(
            f"sent {_bytes(averaged.bytes_sent)}, received {_bytes(averaged.bytes_received)}, "
            f"exchange {averaged.seconds:.2f} s"
        )
    if vote is not None:
        if vote.contribution.plan is not None:
            parts.append(f"codec {vote.contribution.plan.codec}")
        if not vote.ok:
            parts.append(f"exchange failed: {vote.error}")
    return "; ".join(parts) or "no figures (the round ended before this peer trained)"


def round_scalars(
    result: RoundResult, train: Optional[TrainStats], lr: float, vote: Optional[Vote]
) -> dict[str, Optional[float]]:
    scalars: dict[str, Optional[float]] = {
        "round/committed": 1.0 if result.outcome is Outcome.COMMITTED else 0.0,
        "train/lr": lr,
        "round/waited_s": result.waited_s,  # training stood still for the exchange and the decision
    }
    if result.outcome is Outcome.COMMITTED:
        scalars |= {"round/overhead_s": result.overhead_s, "round/eval_s": result.eval_s}
    if train is not None:
        scalars |= {
            "train/loss": train.mean_loss,
            "train/steps": float(train.steps),
            "train/tokens_per_s": train.tokens / max(1e-9, train.inner_time_s),
            "train/step_time_s": train.inner_time_s / max(1, train.steps),
        }
    averaged = vote.averaged if vote is not None else None
    if averaged is not None:
        scalars |= {
            "exchange/bytes_sent": float(averaged.bytes_sent),
            "exchange/bytes_received": float(averaged.bytes_received),
            "exchange/seconds": averaged.seconds,
            "link/upload_mbit_s": averaged.upload_mbit_s,
            "link/download_mbit_s": averaged.download_mbit_s,
            "link/rtt_ms": averaged.rtt_ms,
        }
    return scalars


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
