"""Settling the rounds: the open round decided when it can be, late peers admitted, the next round opened.

``RoundSettler.settle`` runs under the engine's lock after anything a round depends on changed. It does nothing when
nothing changed since the last time and no deadline passed; in a round of more than ``LISTED_PARTICIPANTS``
participants, whose reports and peer states change many times a second, it decides again at most every
``SETTLE_EVERY_S`` on their account (at once when the round itself changed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from coordinator.api.limits import LISTED_PARTICIPANTS
from coordinator.rounds import opening, outcome
from coordinator.rounds.run_state import RunState
from coordinator.store.records import ReportRecord, RoundRecord
from swarm.config import RunConfig

logger = logging.getLogger("coordinator.engine")

SETTLE_EVERY_S = 1.0  # a large open round is decided again on new reports and peer states at most this often
BOOKKEEPING_CHUNK = 500  # a large decided round's participants counted and written per session


@dataclass
class _Bookkeeping:
    """What is left to count and write of a decided round of more than ``LISTED_PARTICIPANTS``."""

    round: RoundRecord
    reports: dict[str, ReportRecord]
    holders: set[str]
    participants: list[str]
    joined: list[str]
    missed: list[str]


class RoundSettler:
    """The open round's decision and the next round's opening, applied to the run's state and history."""

    def __init__(self, state: RunState, config: RunConfig, history, *, started_at: float) -> None:
        self._state, self._config, self._history, self._started_at = state, config, history, started_at
        self._settled: Optional[tuple[int, int, int]] = None  # roster, rounds and reports versions last settled
        self._settled_at = -float("inf")  # when
        self._wait_until = float("inf")  # when the open round is decided even if nothing else happens
        self._bookkeeping: list[_Bookkeeping] = []  # decided large rounds whose participants are still to count

    def settle(self, now: float) -> None:
        """Decide the open round if it can be, admit late peers, open the next round when possible.

        Does nothing when nothing it depends on changed since the last time and no deadline passed (but a chunk of a
        large round's bookkeeping, ``_book_a_chunk``).
        """
        self._book_a_chunk()
        versions = self._state.versions()
        if self._settled == versions and now < self._wait_until:
            return
        open_round = self._state.open
        if self._settled is not None and self._settled[1] == versions[1] and now < self._wait_until \
                and open_round is not None and len(open_round.participants) + len(open_round.left_out) > LISTED_PARTICIPANTS:
            # only reports or peer states changed, in a large round: look again once SETTLE_EVERY_S passed
            self._wait_until = min(self._wait_until, self._settled_at + SETTLE_EVERY_S)
            if now < self._wait_until:
                return
        self._decide(now)
        self._settled, self._settled_at = self._state.versions(), now

    def _decide(self, now: float) -> None:
        self._wait_until = float("inf")
        if self._state.open is not None:
            reports = self._state.reports.by_peer_id()
            alive = self._state.roster.alive_ids
            row, look_again = opening.leave_out_late(now, self._state.open, reports, peers=self._state.peers,
                                                     config=self._config, started_at=self._started_at)
            if row is not self._state.open:
                self._state.save_round(row)
            decision = outcome.decide_round(
                now, self._state.open, alive, reports, self._config.rounds.round_timeout_s,
                report_grace_s=self._config.rounds.report_grace_s, param_count=self._state.run.param_count,
                claims=self._state.reports.claims,
            )
            if not decision.decided:
                self._wait_until = min(decision.wait_until, look_again)
                admitted = opening.admit_late(now, self._state.open, reports, ready=self._state.roster.ready_ids(),
                                                    alive=alive, peers=self._state.peers, config=self._config)
                if admitted is not self._state.open:
                    self._state.save_round(admitted)
                return
            self._apply(decision, now)
        if self._state.run.finished:
            return
        number = (self._state.latest.round if self._state.latest is not None else 0) + 1
        planned, wait_until = opening.open_next(
            now, number, ready=self._state.roster.ready_ids(), carried=self._state.carried(), config=self._config,
            peers=self._state.peers, param_count=self._state.run.param_count, previous=self._state.latest)
        if planned is not None:
            self._state.save_round(planned)
            self._wait_until = wait_until

    def _apply(self, decision: outcome.Decision, now: float) -> None:
        decided = decision.round
        self._state.save_round(decided)
        reports = self._state.reports.by_peer_id()
        if len(decided.participants) <= LISTED_PARTICIPANTS:
            self._history.record_round(decided, reports, self._state.peers, self._config,
                                       ddp_equivalent_bytes=decision.ddp_equivalent_bytes)
            self._state.count_rounds(joined=decision.joined, missed=decision.missed)
        else:  # its row now; its participants counted and their rows written a chunk per session from now on
            self._history.record_round_row(decided, reports, self._config,
                                           ddp_equivalent_bytes=decision.ddp_equivalent_bytes)
            self._bookkeeping.append(_Bookkeeping(decided, {r.peer_id: r for r in reports}, set(decided.holders),
                                                  list(decided.participants), list(decision.joined),
                                                  list(decision.missed)))
        self._state.save_run(self._state.run_after(decision, now=now, max_rounds=self._config.rounds.max_rounds))
        logger.info("round %d: %s", decided.round, decided.reason)

    def _book_a_chunk(self) -> None:
        """A decided large round's next ``BOOKKEEPING_CHUNK`` participants counted (joined or missed) and given their
        history rows: a decision in a swarm of thousands holds the engine's lock for its own work, and the rest
        rides on the sessions that follow, a few milliseconds each, instead of stopping every call for most of a
        second. A restart (or a session rolled back by a bug) drops what was left: counts and rows that only the
        status, the dashboard and the history show; no decision reads them."""
        if not self._bookkeeping:
            return
        book, n = self._bookkeeping[0], BOOKKEEPING_CHUNK
        chunk, book.participants = book.participants[:n], book.participants[n:]
        joined, book.joined = book.joined[:n], book.joined[n:]
        missed, book.missed = book.missed[:n], book.missed[n:]
        self._state.count_rounds(joined=joined, missed=missed)
        self._history.record_peer_rows(book.round, book.reports, self._state.peers, chunk, book.holders)
        if not (book.participants or book.joined or book.missed):
            self._bookkeeping.pop(0)
