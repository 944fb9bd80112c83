"""Round decisions: when a round opens, who takes part, and whether it commits or is voided.

Pure functions with an explicit ``now``; each returns the decision and the reason in words, so the
tests need no clock and the log can say why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

from coordinator.rounds import budgets
from coordinator.store.records import COMMITTED, OPEN, VOIDED, ReportRecord, RoundRecord, finite
from swarm.core.trust import commit_rule


@dataclass(frozen=True)
class Decision:
    round: RoundRecord  # the round as decided (or unchanged while it stays open)
    decided: bool
    reason: str
    joined: tuple[str, ...] = ()  # participants that hold the committed state
    missed: tuple[str, ...] = ()  # the other participants
    ddp_equivalent_bytes: int = 0
    wait_until: float = math.inf  # undecided: when it will be decided even if no report or peer changes


DDP_BYTES_CAP = 2**62  # a round's figure at most: within an int64, as the run's saturating sum of them
RESTARTED = "it restarted"  # the error of the placeholder report a restarted participant's old process leaves
BY_VOTE = "its group's signed vote"  # the error of a stand-in report made from a gone process's DHT vote


def is_restart_placeholder(report: ReportRecord) -> bool:
    return not report.ok and report.error == RESTARTED and not report.state_hash


def is_stand_in(report: ReportRecord) -> bool:
    """A report made from the signed DHT vote of a process that is gone (``coordinator.rounds.offline_votes``): it
    counts for the commit rule, but its peer does not hold what it voted for."""
    return report.error == BY_VOTE


def precedence(report: ReportRecord) -> int:
    """Which of a peer's reports of a round stands: its own (2) over a stand-in from its vote (1) over its
    restart's placeholder (0)."""
    return 0 if is_restart_placeholder(report) else 1 if is_stand_in(report) else 2


def supersedes(report: ReportRecord, earlier: ReportRecord) -> bool:
    """Whether ``report`` replaces a peer's ``earlier`` report of a round (``precedence``), except between its signed
    vote and a failure: a vote stands in only for a process that is gone, so a failure the peer reports itself comes
    from its next process, which was not in the group that voted (restarted, and sent into a round its group had
    already decided, it could not take part). That failure does not undo the old process's vote, and the vote
    replaces it: a chaos soak saw two restarted processes' failures void a round their group had committed."""
    if is_stand_in(earlier) and not report.ok:
        return False
    if is_stand_in(report) and not earlier.ok and not is_stand_in(earlier):
        return True
    return precedence(report) > precedence(earlier)


def decide_round(
    now: float,
    round_row: RoundRecord,
    participants_alive: Collection[str],
    reports: Sequence[ReportRecord],
    round_timeout_s: float,
    *,
    report_grace_s: float = 10.0,
    param_count: int = 0,
    claims: Optional[Mapping[str, commit_rule.Claim]] = None,
) -> Decision:
    """Commit the hash a quorum of its group reported (``swarm.core.trust.commit_rule``), void the round when
    no hash has one, or keep waiting.

    The round waits while a live participant has not reported, until ``round_timeout_s`` after it
    opened, or ``report_grace_s`` after some hash reached its quorum, whichever comes first.
    ``param_count`` is used for reports that do not carry their own.  ``claims`` (by peer id) are the
    reports as ``claim_of`` makes them, when the caller keeps them made. A participant the round went on without
    (``left_out``) that reported counts as planned: it was, and its report stands for it.
    """
    participants, not_counted = _counted_participants(round_row, reports)
    members = set(participants)
    counted = [r for r in reports if r.peer_id in members]
    if claims is None:
        claims = {r.peer_id: claim_of(r, {}) for r in counted}
    claims = [claims[r.peer_id] for r in counted]
    standing = standing_participants(participants, participants_alive, counted)
    pending, restarting = _pending(now, participants, participants_alive, counted, report_grace_s)
    # when none is pending the quorum's time changes nothing (a large round is not ranked twice)
    quorum_at = _quorum_at(commit_rule.candidates(claims, members, standing), counted) if pending else None
    deadline = round_row.opened_at + round_timeout_s
    if quorum_at is not None:
        deadline = min(deadline, quorum_at + report_grace_s)
    until = deadline if restarting is None else min(deadline, restarting)
    if pending and now < until:
        return Decision(
            round=round_row,
            decided=False,
            wait_until=until,
            reason=f"waiting for {len(pending)} of {len(participants)} participants until {until - now:.0f}s from now",
        )
    why = _why_now(
        len(participants),
        len(counted),
        len(pending),
        f"{report_grace_s:.0f}s of a quorum" if quorum_at is not None else f"{round_timeout_s:.0f}s",
    )
    verdict = commit_rule.decide(claims, members, standing)
    return _decision(
        now, round_row, verdict, participants, not_counted, counted, f"{verdict.reason} ({why})", param_count
    )


def _decision(
    now: float,
    round_row: RoundRecord,
    verdict: commit_rule.Verdict,
    participants: tuple[str, ...],
    not_counted: tuple[str, ...],
    counted: Sequence[ReportRecord],
    reason: str,
    param_count: int,
) -> Decision:
    """The decided round: voided, or committed with the holders of the committed hash."""
    mean_loss = _mean([r.loss for r in counted if finite(r.loss) and r.loss > 0])
    # the decided row names every participant it counted: those the others matched without once they had reported
    # (``without_reporters``) are participants of the round again, in its history too
    planned = dict(participants=participants, left_out=not_counted) if participants != round_row.participants else {}
    if verdict.committed_hash is None:
        decided = dataclasses.replace(
            round_row,
            outcome=VOIDED,
            decided_at=now,
            mean_loss=mean_loss,
            reason=reason,
            **planned,
        )
        return Decision(round=decided, decided=True, reason=decided.reason, missed=tuple(participants) + not_counted)
    by_peer = {r.peer_id: r for r in counted}
    holding = {p for p in verdict.holders if not is_stand_in(by_peer[p])}
    holders = tuple(p for p in participants if p in holding)
    decided = dataclasses.replace(
        round_row,
        outcome=COMMITTED,
        decided_at=now,
        committed_hash=verdict.committed_hash,
        holders=holders,
        mean_loss=mean_loss,
        reason=reason,
        **planned,
    )
    return Decision(
        round=decided,
        decided=True,
        reason=decided.reason,
        joined=holders,
        missed=tuple(p for p in participants if p not in holding) + not_counted,
        ddp_equivalent_bytes=ddp_equivalent_bytes([by_peer[p] for p in holders], param_count=param_count),
    )


def _counted_participants(round_row: RoundRecord, reports: Sequence[ReportRecord]) -> tuple[tuple[str, ...], ...]:
    """The participants a decision counts (the planned ones and those left out that reported), and those left out
    that it does not count (they did not report)."""
    spoke = {r.peer_id for r in reports if not is_restart_placeholder(r)}
    planned = set(round_row.participants)
    participants = round_row.participants + tuple(p for p in round_row.left_out if p in spoke and p not in planned)
    members = set(participants)
    return participants, tuple(p for p in round_row.left_out if p not in members)


def leave_out(
    now: float,
    round_row: RoundRecord,
    reports: Sequence[ReportRecord],
    ready: Collection[str],
    *,
    report_grace_s: float,
    not_before: float = 0.0,
) -> tuple[RoundRecord, float]:
    """Past the round's deadline plus ``report_grace_s``, take the participants that have neither reported
    nor started their exchange (``ready``: the participants exchanging this round) out of the round, so the
    others stop waiting for them. Returns the round (the same object when nobody was left out) and when
    to look again (inf: never). Nobody is left out while more than half the participants are late (none
    ready, or most of them slowed down together): the round waits as before, and once more than half are
    ready the late ones get ``report_grace_s`` from then (they were as late as the others by a deadline that
    said nothing of the run's real speed, e.g. start-up probes taken on an idle machine); nor is a participant
    that a successful report names in its group. The row changes (``grace_from``) as the wait starts and ends."""
    if round_row.outcome != OPEN or round_row.deadline_s <= 0:
        return round_row, math.inf
    # ``not_before``: when this coordinator started. A round opened before a restart gets its deadline anew:
    # while the coordinator was down its peers decided rounds with their group, which says nothing of speed
    due = max(round_row.opened_at, not_before) + round_row.deadline_s + report_grace_s
    reported = {r.peer_id for r in reports if not is_restart_placeholder(r)}
    # a participant a report names in its group took part in that exchange: it is not a straggler, its
    # report is on its way (e.g. from its backlog, after the coordinator restarted past the deadline)
    exchanged = {p for r in reports if r.ok for p in r.group}
    late = [p for p in round_row.participants if p not in reported and p not in ready and p not in exchanged]
    if not late:
        return round_row, math.inf
    if now < due:
        return round_row, due
    if 2 * len(late) > len(round_row.participants):
        # most are late: the machine or the run slowed, not a straggler; leaving the majority out would
        # throw its work away, so the round waits as before (look again as they become ready)
        if round_row.grace_from != math.inf:
            round_row = dataclasses.replace(round_row, grace_from=math.inf)
        return round_row, now + 1.0
    if round_row.grace_from == math.inf:  # more than half are ready now: the late ones' grace starts
        return dataclasses.replace(round_row, grace_from=now), now + report_grace_s
    if now < round_row.grace_from + report_grace_s:
        return round_row, round_row.grace_from + report_grace_s
    return budgets.without(round_row, late), math.inf


def without_reporters(round_row: RoundRecord, reports: Sequence[ReportRecord], alive: Collection[str]) -> RoundRecord:
    """``round_row`` with the participants that reported (themselves) while others are still to report moved to
    ``left_out``, whatever group their report names: a peer posts its group entry before it exchanges and reports
    after, so one that reported will never post to the group the others are matching, and they must not wait for it
    (the plan they match by drops it). An honest reporter's groupmates lose nothing by it: they had sent it their
    contributions, so they had closed their matchmaking before it could report. A liar reporting as the round opens,
    with a group of its own or one naming the others, is dropped the same way, so it cannot hold their matchmaking
    until the round's timeout, round after round. Its report still counts as a planned participant's
    (``decide_round``), so that it wins only where it would have: where nobody else stands in the round
    (``standing_participants``). The same object when there are none."""
    if round_row.outcome != OPEN:
        return round_row
    members = set(round_row.participants)
    reported = [p for p in dict.fromkeys(r.peer_id for r in reports if precedence(r) == 2) if p in members]
    done = set(reported)  # membership tests in sets: a round of thousands with thousands of reports stays linear
    waiting = [p for p in round_row.participants if p in alive and p not in done]
    if not reported or not waiting:
        return round_row
    return budgets.without(round_row, reported)


def standing_participants(
    participants: Sequence[str], alive: Collection[str], reports: Sequence[ReportRecord]
) -> frozenset[str]:
    """The planned participants a quorum is a majority of: each one that reported (itself, or by its group's
    signed vote), or is alive and has not restarted out of the round. Only a participant known to be gone
    without a report is not counted, and only its own key can make that so (a restart) or its own silence (an
    eviction): no report can shrink the planned group of others."""
    reported = {r.peer_id for r in reports if not is_restart_placeholder(r)}
    restarted = {r.peer_id for r in reports if is_restart_placeholder(r)}
    return frozenset(p for p in participants if p in reported or (p in alive and p not in restarted))


def _quorum_at(ranked: Sequence[commit_rule.Candidate], reports: Sequence[ReportRecord]) -> Optional[float]:
    """When the leading hash reached its quorum (by the coordinator's clock), or None if it has none."""
    if not ranked or not ranked[0].has_quorum:
        return None
    best = ranked[0]
    supporters = set(best.supporters)
    times = sorted(r.reported_at for r in reports if r.peer_id in supporters)
    return times[best.needed - 1]


def claim_of(report: ReportRecord, groups: dict[frozenset[str], frozenset[str]]) -> commit_rule.Claim:
    """The report as the commit rule reads it; ``groups`` interns equal groups as one object, so that
    the rule compares a round's many copies of one group in O(1)."""
    group = frozenset(report.group)
    return commit_rule.Claim(report.peer_id, report.ok, report.state_hash, groups.setdefault(group, group))


def _pending(
    now: float,
    participants: Sequence[str],
    alive: Collection[str],
    counted: Sequence[ReportRecord],
    report_grace_s: float,
) -> tuple[list[str], Optional[float]]:
    """The live participants the round still waits for, and, when each of them is a restart's placeholder, until
    when (None: until its deadline). A restart's placeholder stands for its peer only ``report_grace_s`` after the
    restart: its new process may still report."""
    restarting = {
        r.peer_id: r.reported_at + report_grace_s
        for r in counted
        if is_restart_placeholder(r) and now < r.reported_at + report_grace_s
    }
    reported = {r.peer_id for r in counted} - set(restarting)
    pending = [p for p in participants if p in alive and p not in reported]
    if any(p not in restarting for p in pending):
        return pending, None
    return pending, max((restarting[p] for p in pending), default=now)


def ddp_equivalent_bytes(holder_reports: Sequence[ReportRecord], *, param_count: int = 0) -> int:
    """What data-parallel training would have sent for the same inner steps.

    A ring all-reduce of fp32 gradients sends 2(K−1)/K × 4 × param_count bytes per peer per step.
    """
    k = len(holder_reports)
    if k <= 1:
        return 0
    per_step_factor = 2 * (k - 1) / k * 4
    total = sum(max(r.inner_steps, 0) * per_step_factor * max(r.param_count or param_count, 0) for r in holder_reports)
    return int(round(min(total, DDP_BYTES_CAP))) if math.isfinite(total) else DDP_BYTES_CAP


def finishes_run(round_row: RoundRecord, committed_rounds: int, max_rounds: Optional[int]) -> bool:
    """A run with max_rounds finishes once that many rounds have committed (voided rounds don't count)."""
    return round_row.outcome == COMMITTED and bool(max_rounds) and committed_rounds >= max_rounds


def _why_now(n_participants: int, n_reported: int, n_pending: int, within: str) -> str:
    if n_pending:
        return f"{n_pending} participants did not report within {within}"
    if n_reported < n_participants:
        return f"{n_reported} of {n_participants} participants reported, the rest are gone"
    return f"all {n_participants} participants reported"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
