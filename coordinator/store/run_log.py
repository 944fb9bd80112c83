"""The run's curves for TensorBoard / W&B ([logging] in the run config), written where the history is kept:
per decided round, committed and voided counts, train loss, utilization, bytes against data-parallel,
participants, exchange seconds and the controller's codec; per evaluated round, the peers' mean eval loss.

Evaluations arrive in heartbeats after their round was decided; a round's mean is written once every peer
that holds its state has evaluated it, or else when the next round is decided, so each round gets one point.
"""

from __future__ import annotations

import json
import math

from coordinator.store.database import Store
from coordinator.store.history import History, HistoryStore
from coordinator.store.records import COMMITTED, VOIDED, RoundRecord
from swarm.config import RunConfig
from swarm.train.train_log import COORDINATOR_NAME, TrainLog, open_train_log
from swarm.v1 import coordinator_pb2 as pb

CODEC_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4}


class RunLog:
    """The coordinator's training log; owned by the engine, used under its lock. It outlives the engine's
    ``History`` objects (the engine makes a new one when a transaction rolls back)."""

    def __init__(self, train_log: TrainLog, *, committed: int = 0, voided: int = 0) -> None:
        self.train_log = train_log
        self._committed, self._voided = committed, voided  # the run's totals, from the store at a restart
        self._evals: dict[int, list[float]] = {}  # round -> the eval losses heard and not yet written
        self._holders: dict[int, int] = {}  # committed round -> how many peers hold its state (and evaluate it)

    def history(self, store: HistoryStore) -> History:
        """The engine's history: a plain ``History``, or one that also tells this log, when it is on."""
        return LoggedHistory(store, self) if self.train_log.on else History(store)

    def decided(self, decided: RoundRecord, row: pb.RoundHistory) -> None:
        committed = decided.outcome == COMMITTED
        self._committed += committed
        self._voided += not committed
        self.train_log.log(
            decided.round, round_scalars(row, self._committed, self._voided, controller_codec(decided.choice))
        )
        for round_no in [r for r in self._evals if r < decided.round]:
            self._write_eval(round_no)  # its other peers moved on without evaluating it
        if committed:
            self._holders[decided.round] = max(1, row.holders)

    def evaluated(self, eval_round: int, loss: float) -> None:
        self._evals.setdefault(eval_round, []).append(loss)
        if len(self._evals[eval_round]) >= self._holders.get(eval_round, math.inf):
            self._write_eval(eval_round)

    def close(self) -> None:
        for round_no in sorted(self._evals):
            self._write_eval(round_no)
        self.train_log.close()

    def _write_eval(self, round_no: int) -> None:
        losses = self._evals.pop(round_no)
        self._holders.pop(round_no, None)
        self.train_log.log(round_no, {"eval/loss": sum(losses) / len(losses), "eval/peers": float(len(losses))})


def open_run_log(store: Store, config: RunConfig) -> RunLog:
    """The log [logging] asks for, for the run kept in ``store`` (its id groups the run's W&B runs)."""
    run = store.get_run()
    train_log = open_train_log(
        config.logging, name=COORDINATOR_NAME, group=run.run_id if run else "", run_config=config.to_dict()
    )
    if not train_log.on:
        return RunLog(train_log)
    return RunLog(train_log, committed=store.count_rounds(COMMITTED), voided=store.count_rounds(VOIDED))


class LoggedHistory(History):
    """A ``History`` that also hands each round it records, and each evaluation it keeps, to a ``RunLog``."""

    def __init__(self, store: HistoryStore, run_log: RunLog) -> None:
        super().__init__(store)
        self.run_log = run_log

    def record_decided(self, decided: RoundRecord, row: pb.RoundHistory) -> None:
        super().record_decided(decided, row)
        self.run_log.decided(decided, row)

    def record_eval(self, peer_id: str, eval_round: int, loss: float) -> None:
        before = self._last_eval.get(peer_id)
        super().record_eval(peer_id, eval_round, loss)
        if self._last_eval.get(peer_id) != before:  # kept: not a repeat, nor a bad value
            self.run_log.evaluated(eval_round, loss)


def controller_codec(choice_json: str) -> str:
    """The codec the controller chose for a round ("" when it is off), from the round's stored choice."""
    if not choice_json:
        return ""
    try:
        codec = json.loads(choice_json).get("codec", "")
    except (ValueError, AttributeError):
        return ""
    return codec if codec in CODEC_BITS else ""


def round_scalars(row: pb.RoundHistory, committed: int, voided: int, codec: str) -> dict[str, float]:
    scalars = {
        "rounds/committed_total": float(committed),
        "rounds/voided_total": float(voided),
        "round/committed": 1.0 if row.outcome == pb.ROUND_OUTCOME_COMMITTED else 0.0,
        "round/participants": float(row.participants),
        "round/group_size": float(row.group_size),
        "train/loss": row.mean_loss,
        "run/utilization": row.utilization,
        "run/tokens": float(row.tokens),
        "exchange/bytes_sent": float(row.bytes_sent),
        "exchange/ddp_equivalent_bytes": float(row.ddp_equivalent_bytes),
        "exchange/seconds": row.exchange_s,
        "train/inner_seconds": row.inner_s,
    }
    if codec:
        scalars["controller/codec_bits"] = float(CODEC_BITS[codec])
    return scalars
