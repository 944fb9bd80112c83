"""Settling the rounds: the open round decided when it can be, late peers admitted, the next round opened.

``RoundSettler.settle`` runs under the engine's lock after anything a round depends on changed. It does nothing when
nothing changed since the last time and no deadline passed; in a round of more than ``LISTED_PARTICIPANTS``
participants, whose reports and peer states change many times a second, it decides again at most every
``SETTLE_EVERY_S`` on their account (at once when the round itself changed).
"""

from __future__ import annotations

import logging
from typing import Optional

from coordinator.api.limits import LISTED_PARTICIPANTS
from coordinator.rounds import opening, outcome
from coordinator.rounds.recording import RoundRecorder
from coordinator.rounds.run_state import RunState
from swarm.config import RunConfig

logger = logging.getLogger("coordinator.engine")

SETTLE_EVERY_S = 1.0  # a large open round is decided again on new reports and peer states at most this often


class RoundSettler:
    """The open round's decision and the next round's opening, applied to the run's state and history."""

    def __init__(self, state: RunState, config: RunConfig, recorder: RoundRecorder, *, started_at: float) -> None:
        self._state, self._config, self._recorder, self._started_at = state, config, recorder, started_at
        self._settled: Optional[tuple[int, int, int]] = None  # roster, rounds and reports versions last settled
        self._settled_at = -float("inf")  # when
        self._wait_until = float("inf")  # when the open round is decided even if nothing else happens

    def settle(self, now: float) -> None:
        """Decide the open round if it can be, admit late peers, open the next round when possible.

        Does nothing when nothing it depends on changed since the last time and no deadline passed.
        """
        versions = self._state.versions()
        if self._settled == versions and now < self._wait_until:
            return
        open_round = self._state.open
        if (
            self._settled is not None
            and self._settled[1] == versions[1]
            and now < self._wait_until
            and open_round is not None
            and len(open_round.participants) + len(open_round.left_out) > LISTED_PARTICIPANTS
        ):
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
            row, look_again = opening.leave_out_late(
                now,
                self._state.open,
                reports,
                peers=self._state.peers,
                alive=alive,
                config=self._config,
                started_at=self._started_at,
            )
            if row is not self._state.open:
                self._state.save_round(row)
            decision = outcome.decide_round(
                now,
                self._state.open,
                alive,
                reports,
                self._config.rounds.round_timeout_s,
                report_grace_s=self._config.rounds.report_grace_s,
                param_count=self._state.run.param_count,
                claims=self._state.reports.claims,
            )
            if not decision.decided:
                self._wait_until = min(decision.wait_until, look_again)
                admitted = opening.admit_late(
                    now,
                    self._state.open,
                    reports,
                    ready=self._state.roster.ready_ids(),
                    alive=alive,
                    peers=self._state.peers,
                    config=self._config,
                )
                if admitted is not self._state.open:
                    self._state.save_round(admitted)
                return
            self._apply(decision, now)
        if self._state.run.finished:
            return
        number = (self._state.latest.round if self._state.latest is not None else 0) + 1
        planned, wait_until = opening.open_next(
            now,
            number,
            ready=self._state.roster.ready_ids(),
            carried=self._state.carried(),
            config=self._config,
            peers=self._state.peers,
            param_count=self._state.run.param_count,
            previous=self._state.latest,
        )
        if planned is not None:
            self._state.save_round(planned)
            self._wait_until = wait_until

    def _apply(self, decision: outcome.Decision, now: float) -> None:
        decided = decision.round
        self._state.save_round(decided)
        counted = self._state.count_rounds(joined=decision.joined, missed=decision.missed)
        self._recorder.decided(
            decided,
            self._state.reports.by_peer_id(),
            ddp_equivalent_bytes=decision.ddp_equivalent_bytes,
            counted=counted,
        )
        self._state.save_run(self._state.run_after(decision, now=now, max_rounds=self._config.rounds.max_rounds))
        logger.info("round %d: %s", decided.round, decided.reason)
