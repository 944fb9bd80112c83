"""Opening a round and growing it: the round's plan (participants, the controller's choice, each one's step
budget) and late admission, from the engine's view of the run. The engine saves what these return."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Collection, Mapping, Optional, Sequence

from coordinator.rounds import budgets, controller, outcome
from coordinator.store.records import EXCHANGING, OPEN, PeerRecord, ReportRecord, RoundRecord
from swarm.config import RunConfig

logger = logging.getLogger(__name__)


def open_next(
    now: float,
    number: int,
    *,
    ready: Sequence[str],
    carried: Sequence[str],
    config: RunConfig,
    peers: Mapping[str, PeerRecord],
    param_count: int,
    previous: Optional[RoundRecord],
) -> tuple[Optional[RoundRecord], float]:
    """Round ``number`` planned (None: not enough ready peers yet), and when the engine must look at it again
    even if nothing changes: its timeout should no one report, or its deadline, after which who is not
    ready is left out."""
    planned, _why_not = new_round(
        now=now, round_number=number, ready=ready, carried=carried, min_peers=config.rounds.min_peers
    )
    if planned is None:
        return None, math.inf
    planned = controller.for_round(config, planned, peers, param_count, previous)
    planned = budgets.budgeted(planned, peers, config.rounds)
    wait_until = planned.opened_at + config.rounds.round_timeout_s
    if planned.deadline_s > 0:
        wait_until = min(wait_until, planned.opened_at + planned.deadline_s + config.rounds.report_grace_s)
    logger.info(
        "round %d: opened with %s (inner steps %s, time budget %.3gs)",
        number,
        ", ".join(planned.participants),
        ", ".join(map(str, planned.budgets)),
        planned.budget_s,
    )
    return planned, wait_until


def admit_late(
    now: float,
    open_round: RoundRecord,
    reports: Sequence[ReportRecord],
    *,
    ready: Sequence[str],
    alive: Collection[str],
    peers: Mapping[str, PeerRecord],
    config: RunConfig,
) -> RoundRecord:
    """``open_round`` with the newly ready peers admitted and budgeted (the same object when none is):
    until its first report, or until a participant is seen exchanging it."""
    exchanging = not reports and any(  # admission closes at the first report anyway
        p in alive and peers[p].state == EXCHANGING and peers[p].metrics.round == open_round.round
        for p in open_round.participants
    )
    admitted = with_late_joiners(open_round, reports, ready, exchange_started=exchanging)
    if admitted is open_round:
        return open_round
    admitted = budgets.budget_newcomers(open_round, admitted, peers, config.rounds, now=now)
    logger.info(
        "round %d: admitted late %s", admitted.round, ", ".join(admitted.participants[len(open_round.participants) :])
    )
    return admitted


def leave_out_late(
    now: float,
    open_round: RoundRecord,
    reports: Sequence[ReportRecord],
    *,
    peers: Mapping[str, PeerRecord],
    alive: Collection[str],
    config: RunConfig,
    started_at: float = 0.0,
) -> tuple[RoundRecord, float]:
    """``open_round`` without the participants not ready by its deadline (the same object when none is left
    out), and when to look again. ``alive``: the ids of the peers not gone."""
    row = outcome.without_reporters(open_round, reports, alive)
    if row is not open_round:
        logger.info(
            "round %d: the others match without %s (reported while others were still to report)",
            row.round,
            ", ".join(row.left_out[len(open_round.left_out) :]),
        )
        open_round = row
    row, look_again = outcome.leave_out(
        now,
        open_round,
        reports,
        budgets.exchanging(open_round, peers) if open_round.deadline_s > 0 else (),  # () unread without a deadline
        report_grace_s=config.rounds.report_grace_s,
        not_before=started_at,
    )
    if len(row.left_out) > len(open_round.left_out):
        late_by = f"its {row.deadline_s:.3g}s deadline" if not open_round.grace_from else "more than half were ready"
        logger.warning(
            "round %d: went on without %s (not ready %.0fs after %s)",
            row.round,
            ", ".join(row.left_out[len(open_round.left_out) :]),
            config.rounds.report_grace_s,
            late_by,
        )
    return row, look_again


def new_round(
    *, now: float, round_number: int, ready: Sequence[str], carried: Sequence[str] = (), min_peers: int = 1
) -> tuple[Optional[RoundRecord], str]:
    """Open round ``round_number`` with the carried holders plus the ready peers, if there are enough.

    ``min_peers`` applies to round 1 only; a later round needs one peer.
    """
    participants = tuple(dict.fromkeys([*carried, *ready]))
    needed = min_peers if round_number == 1 else 1
    if len(participants) < needed:
        return None, f"round {round_number} waits for {needed} ready peers, has {len(participants)}"
    round_row = RoundRecord(round=round_number, opened_at=now, participants=participants, outcome=OPEN)
    return round_row, f"round {round_number} opened with {len(participants)} participants"


def with_late_joiners(
    round_row: RoundRecord, reports: Sequence[ReportRecord], ready: Sequence[str], *, exchange_started: bool = False
) -> RoundRecord:
    """Append newly ready peers to an open round until its first report arrives or its exchange starts.

    After that the participants may already be matching their groups by the plan, so it stays fixed.
    """
    if round_row.outcome != OPEN or reports or exchange_started:
        return round_row
    planned = set(round_row.participants) | set(round_row.left_out)  # the round went on without those
    newcomers = tuple(p for p in ready if p not in planned)
    if not newcomers:
        return round_row
    return dataclasses.replace(round_row, participants=round_row.participants + newcomers)
