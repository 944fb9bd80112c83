"""The run's history: one row per decided round and one per participant and round, kept in the store.

``round_history`` and ``peer_round_history`` are pure: the engine hands them the round it just decided,
that round's reports and the peers' latest metrics, and ``History`` saves what they make.  Evaluations
arrive later, in heartbeats (a peer evaluates the state a round committed), so they are kept apart, one
per peer and round, and averaged when the history is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional, Protocol, Sequence

from coordinator.api.errors import BadRequest
from coordinator.rounds import controller
from coordinator.store.records import COMMITTED, PeerRecord, ReportRecord, RoundRecord, finite
from swarm.config import RunConfig
from swarm.core.trust import commit_rule
from swarm.v1 import coordinator_pb2 as pb

DEFAULT_HISTORY_ROUNDS = 1000  # rounds per GetHistory answer when the caller does not say
MAX_HISTORY_ROUNDS = 5000  # a round and its participants' rows are small; a page stays well under 4 MB


class HistoryStore(Protocol):
    def put_history(self, row: pb.RoundHistory, peer_rows: Sequence[pb.PeerRoundHistory]) -> None: ...

    def put_peer_history(self, peer_rows: Sequence[pb.PeerRoundHistory]) -> None: ...

    def add_eval(self, round_number: int, peer_id: str, loss: float) -> None: ...


INT64_MAX = 2**63 - 1


def int64(value: float) -> int:
    """``value`` as a protobuf int64 takes it: negative and non-finite as 0, beyond the range as its largest. Every
    count derived from stored figures goes through it, so no stored value can make building a record fail."""
    if not finite(value) or value <= 0:
        return 0
    return int(min(value, INT64_MAX))


def seconds(value: float) -> float:
    """A stored duration or loss as a record shows it: non-finite as NaN (it means: unknown)."""
    return float(value) if finite(value) else math.nan


def round_history(
    decided: RoundRecord, reports: Sequence[ReportRecord], config: RunConfig, *, ddp_equivalent_bytes: int
) -> pb.RoundHistory:
    """The history row of the round ``decided`` (committed or voided) from its participants' reports; total over
    any stored values (``int64``)."""
    participants = set(decided.participants)
    totals = RoundTotals()
    totals.add(decided, [r for r in reports if r.peer_id in participants])
    return totals.row(decided, config, ddp_equivalent_bytes=ddp_equivalent_bytes)


@dataclass
class RoundTotals:
    """What a round's history row adds up over its participants' reports, added to a part at a time (a round of
    thousands is recorded over several calls): seconds over the finite ones, counts each within an int64."""

    reported: int = 0
    inner_s: float = 0
    exchange_s: float = 0
    longest_exchange_s: Optional[float] = None
    bytes_sent: int = 0
    bytes_received: int = 0
    group_size: int = 0
    samples_in_state: int = 0  # of the reports whose samples are in the committed state (``_in_state``)

    def add(self, decided: RoundRecord, reports: Sequence[ReportRecord]) -> None:
        """Count ``reports``, participants' reports of ``decided`` not counted before."""
        for r in reports:
            self.reported += 1
            if finite(r.inner_time_s):
                self.inner_s += max(r.inner_time_s, 0.0)
            if finite(r.exchange_time_s):
                self.exchange_s += max(r.exchange_time_s, 0.0)
                longest = self.longest_exchange_s
                self.longest_exchange_s = r.exchange_time_s if longest is None else max(longest, r.exchange_time_s)
            self.bytes_sent += int64(r.bytes_sent)
            self.bytes_received += int64(r.bytes_received)
            self.group_size = max(self.group_size, commit_rule.group_size(r.group))
        self.samples_in_state += sum(int64(r.samples) for r in _in_state(decided, reports))

    def row(self, decided: RoundRecord, config: RunConfig, *, ddp_equivalent_bytes: int) -> pb.RoundHistory:
        """The history row of ``decided`` once every participant's report was added."""
        choice = controller.from_json(decided.choice)  # the controller's codec, when it chose one for this round
        inner, exchange = self.inner_s, self.exchange_s
        return pb.RoundHistory(
            round=int64(decided.round),
            outcome=decided.outcome,
            opened_at=seconds(decided.opened_at),
            decided_at=seconds(decided.decided_at or 0.0),
            participants=len(decided.participants),
            reported=self.reported,
            holders=len(decided.holders),
            group_size=self.group_size,
            codec=choice.codec if choice is not None else config.rounds.codec,
            inner_steps=int64(max(decided.budgets, default=config.rounds.inner_steps)),
            fragments=config.rounds.fragments,
            bytes_sent=int64(self.bytes_sent),
            bytes_received=int64(self.bytes_received),
            ddp_equivalent_bytes=int64(ddp_equivalent_bytes),
            exchange_s=seconds(self.longest_exchange_s if self.longest_exchange_s is not None else 0.0),
            inner_s=seconds(inner / self.reported) if self.reported else 0.0,
            mean_loss=seconds(decided.mean_loss),
            eval_loss=math.nan,
            tokens=int64(self.samples_in_state * config.data.seq_len),
            utilization=seconds(inner / (inner + exchange)) if inner + exchange > 0 else 0.0,
            committed_hash=decided.committed_hash if decided.outcome == COMMITTED else "",
            reason=decided.reason,
        )


def _in_state(decided: RoundRecord, reports: Sequence[ReportRecord]) -> list[ReportRecord]:
    """The reports whose samples are in the committed state: none of a voided round (its peers' work carries into
    their next contribution) or of a participant whose exchange failed (it resyncs: its work is lost)."""
    if decided.outcome != COMMITTED:
        return []
    return [r for r in reports if r.ok and r.state_hash == decided.committed_hash]


def peer_round_history(
    decided: RoundRecord,
    reports: Sequence[ReportRecord] | Mapping[str, ReportRecord],
    peers: Mapping[str, PeerRecord],
    *,
    participants: Optional[Sequence[str]] = None,
    holders: AbstractSet[str] = frozenset(),
) -> list[pb.PeerRoundHistory]:
    """One row per participant of ``decided`` (or of ``participants``, some of them, with ``holders`` the round's
    holders as a set): its report (if any, ``reports`` a list or by peer id) and its latest heartbeat's figures."""
    by_peer = reports if isinstance(reports, Mapping) else {r.peer_id: r for r in reports}
    if participants is None:
        participants, holders = decided.participants, set(decided.holders)
    rows = []
    for peer_id in participants:
        report: Optional[ReportRecord] = by_peer.get(peer_id)
        peer = peers.get(peer_id)
        metrics = peer.metrics if peer is not None else pb.PeerMetrics()
        rows.append(
            pb.PeerRoundHistory(
                round=decided.round,
                peer_id=peer_id,
                site=peer.site if peer is not None else "",
                ok=bool(report and report.ok),
                holder=peer_id in holders,
                loss=seconds(report.loss) if report is not None else math.nan,
                inner_s=seconds(report.inner_time_s) if report is not None else 0.0,
                exchange_s=seconds(report.exchange_time_s) if report is not None else 0.0,
                bytes_sent=int64(report.bytes_sent) if report is not None else 0,
                tokens_per_s=metrics.tokens_per_s,
                step_time_s=metrics.step_time_s,
                upload_mbit_s=_measured(metrics.upload_mbit_s),
                download_mbit_s=_measured(metrics.download_mbit_s),
                rtt_ms=_measured(metrics.rtt_ms),
            )
        )
    return rows


def _measured(value: float) -> float:
    return value if finite(value) and value > 0 else math.nan  # 0: never measured


class History:
    """Writes the history as the engine decides rounds and hears evaluations; owned by the engine, used under
    its lock.  Remembers each peer's last evaluation so that the heartbeats repeating it write nothing."""

    def __init__(self, store: HistoryStore) -> None:
        self._store = store
        self._last_eval: dict[str, int] = {}  # peer id -> the round of the evaluation last kept

    def record_round(
        self,
        decided: RoundRecord,
        reports: Sequence[ReportRecord],
        peers: Mapping[str, PeerRecord],
        config: RunConfig,
        *,
        ddp_equivalent_bytes: int,
    ) -> None:
        self._store.put_peer_history(peer_round_history(decided, reports, peers))
        self.record_decided(decided, round_history(decided, reports, config, ddp_equivalent_bytes=ddp_equivalent_bytes))

    def record_participants(self, rows: Sequence[pb.PeerRoundHistory]) -> None:
        """Keep some participants' rows of a round whose own row comes later (``record_decided``)."""
        self._store.put_peer_history(rows)

    def record_decided(self, decided: RoundRecord, row: pb.RoundHistory) -> None:
        """Keep ``decided``'s row, once its participants' rows are kept: a round read back has all of them."""
        self._store.put_history(row, ())

    def record_eval(self, peer_id: str, eval_round: int, loss: float) -> None:
        """Keep ``peer_id``'s evaluation of round ``eval_round``'s state (round 0: the initial state)."""
        if eval_round < 0 or not (finite(loss) and loss > 0) or self._last_eval.get(peer_id) == eval_round:
            return
        self._last_eval[peer_id] = eval_round
        self._store.add_eval(eval_round, peer_id, loss)


class HistoryReader(Protocol):
    def history(self, *, after_round: int = 0, limit: int = -1) -> list[pb.RoundHistory]: ...

    def peer_history(self, *, first_round: int, last_round: int) -> list[pb.PeerRoundHistory]: ...


def history_page(store: HistoryReader, *, after_round: int = 0, max_rounds: int = 0) -> pb.GetHistoryResponse:
    """The decided rounds after ``after_round`` (at most ``max_rounds``, capped) and their participants' rows."""
    if after_round < 0:
        raise BadRequest(f"after_round {after_round} is negative; ask for rounds after 0 (the start) or later.")
    size = min(max_rounds, MAX_HISTORY_ROUNDS) if max_rounds > 0 else DEFAULT_HISTORY_ROUNDS
    rounds = store.history(after_round=after_round, limit=size + 1)
    more = len(rounds) > size
    rounds = rounds[:size]
    response = pb.GetHistoryResponse(rounds=rounds, more=more)
    if rounds:
        response.peer_rounds.extend(store.peer_history(first_round=rounds[0].round, last_round=rounds[-1].round))
    return response
