"""A decided round's bookkeeping: its history rows and its participants' counters on disk, a part per call.

Deciding a round of 10,000 participants is cheap; writing a history row and the counted record of each of them is
not (0.2–0.3 s on one core), and the engine's one lock would hold every other call while it ran. So a decision
changes memory at once (the round, the roster's counters: what every answer reads) and hands the writing to
``RoundRecorder``, which does ``PART`` participants a call, the round's own history row last: a round read back from
the history has all its participants' rows. A round of up to ``PART`` is written by the call that decided it.

A coordinator stopped before a round's rows were all written writes them again when it opens the store
(``RoundRecorder.resume``), from the round's kept reports; what it cannot write again is the unwritten part's
counters (``rounds_joined``/``rounds_missed``), which a crash leaves one round short. Owned by the engine, used under
its lock."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping, Sequence

from coordinator.rounds import outcome
from coordinator.store.database import Store
from coordinator.store.history import History, RoundTotals, peer_round_history
from coordinator.store.records import PeerRecord, ReportRecord, RoundRecord
from swarm.config import RunConfig

PART = 200  # participants written per call


@dataclasses.dataclass
class _Unwritten:
    decided: RoundRecord
    reports: Mapping[str, ReportRecord]  # the round's reports by peer id
    ddp_equivalent_bytes: int
    counted: Sequence[str]  # the peers whose counters the decision changed (none when written again)
    holders: frozenset[str]
    totals: RoundTotals = dataclasses.field(default_factory=RoundTotals)
    done: int = 0  # how many of the participants' rows (and of ``counted``) are written

    def finished(self) -> bool:
        return self.done >= max(len(self.decided.participants), len(self.counted))


class RoundRecorder:
    def __init__(self, history: History, store: Store, peers: Mapping[str, PeerRecord], config: RunConfig) -> None:
        self._history, self._store, self._peers, self._config = history, store, peers, config
        self._unwritten: collections.deque[_Unwritten] = collections.deque()

    def decided(
        self,
        decided: RoundRecord,
        reports: Sequence[ReportRecord],
        *,
        ddp_equivalent_bytes: int,
        counted: Sequence[str],
    ) -> None:
        """Write ``decided``'s history and the records of the peers ``counted`` for it: its first part now."""
        self._unwritten.append(
            _Unwritten(
                decided, {r.peer_id: r for r in reports}, ddp_equivalent_bytes, counted, frozenset(decided.holders)
            )
        )
        self.write()

    def resume(self, *, param_count: int) -> None:
        """Write again the history of the rounds decided before a stop that cut their writing short (and of those a
        store of schema 3, which kept no history, decided)."""
        for number in self._store.rounds_without_history():
            decided = self._store.get_round(number)
            reports = {r.peer_id: r for r in self._store.reports(number)}
            holding = [reports[p] for p in decided.holders if p in reports]
            ddp = outcome.ddp_equivalent_bytes(holding, param_count=param_count)
            self._unwritten.append(_Unwritten(decided, reports, ddp, (), frozenset(decided.holders)))

    def write(self, budget: float = PART) -> None:
        """Write up to ``budget`` participants' rows and records, oldest round first (``math.inf``: all of them)."""
        while self._unwritten and budget > 0:
            part = self._unwritten[0]
            size = PART if math.isinf(budget) else int(budget)
            self._write_part(part, part.done, part.done + size)
            part.done += size
            budget -= size
            if part.finished():
                self._history.record_decided(
                    part.decided,
                    part.totals.row(part.decided, self._config, ddp_equivalent_bytes=part.ddp_equivalent_bytes),
                )
                self._unwritten.popleft()

    def _write_part(self, part: _Unwritten, start: int, end: int) -> None:
        ids = part.decided.participants[start:end]
        if ids:
            self._history.record_participants(
                peer_round_history(part.decided, part.reports, self._peers, participants=ids, holders=part.holders)
            )
            part.totals.add(part.decided, [part.reports[p] for p in ids if p in part.reports])
        counted = [self._peers[p] for p in part.counted[start:end] if p in self._peers]
        if counted:
            self._store.put_counters(counted)
