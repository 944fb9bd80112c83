"""The open round's reports: as the peers sent them, kept in the store, and as the commit rule reads them."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional

from coordinator.api.errors import BadRequest
from coordinator.api.limits import MAX_COUNT, MAX_GROUP, MAX_ROUND
from coordinator.rounds import offline_votes, outcome
from coordinator.store.database import Store
from coordinator.store.records import PeerRecord, ReportRecord, RoundRecord, finite
from swarm.config import RunConfig
from swarm.core.trust import commit_rule
from swarm.core.trust.round_vote import Vote
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


class RoundReports:
    """One open round's reports by peer id, with their claims kept made and their groups interned, so
    that deciding the round again after each report does not rebuild them all.  Owned by the engine,
    used under its lock only."""

    def __init__(self, store: Store, round_number: Optional[int] = None) -> None:
        """The reports of round ``round_number`` that ``store`` holds; none for a round just opened (None)."""
        self._store = store
        self._reports: dict[str, ReportRecord] = {}
        self._groups: dict[frozenset[str], frozenset[str]] = {}  # the round's reported groups, interned
        self.claims: dict[str, commit_rule.Claim] = {}
        self.version = 0  # bumped by every report kept (a replaced one too)
        for report in store.reports(round_number) if round_number is not None else ():
            self._keep(report)

    def add(self, report: ReportRecord) -> bool:
        """Keep ``report``, in the store too; False when this peer already reported (the first one stands),
        except that a peer's own report replaces a stand-in or placeholder, and a stand-in a failure of its next
        process (``outcome.supersedes``)."""
        earlier = self._reports.get(report.peer_id)
        if earlier is not None and outcome.supersedes(report, earlier):
            self._store.replace_report(report)
        elif not self._store.add_report(report):
            return False
        self._keep(report)
        return True

    def _keep(self, report: ReportRecord) -> None:
        self._reports[report.peer_id] = report
        self.claims[report.peer_id] = outcome.claim_of(report, self._groups)
        self.version += 1

    def __len__(self) -> int:
        return len(self._reports)

    def adopt(
        self,
        round_row: RoundRecord,
        votes: Mapping[str, Vote],
        *,
        reporter: str,
        peers: Mapping[str, PeerRecord],
        now: float,
        outage: AbstractSet[str] = frozenset(),
    ) -> RoundRecord:
        """The open round as the group that decided it by ``votes`` had it, the votes of its members whose process
        is gone kept as their reports (``coordinator.rounds.offline_votes``); ``round_row`` itself when nothing changed."""
        if not votes:
            return round_row
        adopted, stand_ins = offline_votes.adopt(
            round_row, self._reports, votes, reporter=reporter, peers=peers, now=now, outage=outage
        )
        for stand_in in stand_ins:
            self.add(stand_in)
        return adopted

    def by_peer_id(self) -> list[ReportRecord]:
        return sorted(self._reports.values(), key=lambda r: r.peer_id)


MAX_LOSS = 1e6  # a loss above it is no measurement (a cross-entropy of a 1e6-token vocabulary is under 14)
BYTES_PER_PARAMETER = 64  # per round, sent or received: a butterfly sends under 2 x 4 bytes a parameter
MAX_RANKS = 64  # data-parallel ranks of one peer (swarm peer --nproc): each draws its own batch a step


@dataclass(frozen=True)
class ReportBounds:
    """What a round asked of one participant, which its report's figures cannot exceed: they are clamped to it
    as the report arrives, so that no figure stored can overflow what is derived from it (history, totals)."""

    inner_steps: int  # its step budget (and the steps an overlapped exchange may add)
    samples: int  # its budget x the batch x MAX_RANKS x the fragments, for each round since the last commit
    seconds: float  # the round's length so far (at least its timeout)
    param_count: int  # the run's model (0: not known yet)


def report_bounds(
    round_row: RoundRecord,
    peer_id: str,
    config: RunConfig,
    *,
    now: float,
    param_count: int,
    rounds_covered: int,
    places: Optional[Mapping[str, int]] = None,
) -> ReportBounds:
    """The bounds of ``peer_id``'s report of ``round_row``: ``rounds_covered`` is how many rounds its
    contribution may carry (a voided round's work goes into the next one). ``places``: each participant's place in
    ``round_row.participants``, when the caller keeps them."""
    budgets = round_row.budgets
    if places is None:
        places = {peer_id: round_row.participants.index(peer_id)} if peer_id in round_row.participants else {}
    if len(budgets) == len(round_row.participants) and peer_id in places:
        steps = budgets[places[peer_id]]
    else:  # admitted by its group's votes, or a plan without budgets: the round's largest
        steps = max(budgets, default=0)
    steps = max(steps, config.rounds.inner_steps if not budgets else 1) + config.rounds.overlap_steps
    # a fragment's contribution carries the samples since its own last sync: one sync every `fragments` rounds
    per_round = steps * config.data.batch_size * MAX_RANKS * config.rounds.fragments
    return ReportBounds(
        inner_steps=steps,
        samples=per_round * max(1, min(rounds_covered, MAX_ROUND)),
        seconds=max(now - round_row.opened_at, config.rounds.round_timeout_s, 0.0),
        param_count=max(param_count, 0),
    )


def report_record(req: pb.ReportRoundRequest, now: float, bounds: Optional[ReportBounds] = None) -> ReportRecord:
    """The report ``req`` makes, as received at ``now``, its figures within ``bounds`` (None: as sent)."""
    record = ReportRecord(
        round=req.round,
        peer_id=req.peer_id,
        reported_at=now,
        ok=req.ok,
        state_hash=req.state_hash,
        group=reported_group(req),
        samples=req.samples,
        inner_steps=req.inner_steps,
        inner_time_s=req.inner_time_s,
        exchange_time_s=req.exchange_time_s,
        bytes_sent=req.bytes_sent,
        bytes_received=req.bytes_received,
        loss=req.loss,
        error=req.error,
        param_count=req.param_count,
    )
    return record if bounds is None else bounded(record, bounds)


MAX_SIZED_GROUP = 10**7  # members a group reported by its digest may say it has


def reported_group(req: pb.ReportRoundRequest) -> tuple[str, ...]:
    """The group ``req`` names, or (a group too large to name) its digest and size as ``commit_rule.sized_group``.
    BadRequest (one sentence) for a sized group that could have been named or is not one."""
    if not req.group_digest and not req.group_size:
        return tuple(req.group)
    if (
        req.group
        or req.group_votes
        or not MAX_GROUP < req.group_size <= MAX_SIZED_GROUP
        or len(req.group_digest) != 16
        or any(c not in "0123456789abcdef" for c in req.group_digest)
    ):
        raise BadRequest(
            f"round {req.round}: a group reported by its digest needs 16 lowercase hex digits, more than "
            f"{MAX_GROUP} and at most {MAX_SIZED_GROUP} members, and no named members or votes; name a "
            f"group of up to {MAX_GROUP} members in `group` instead."
        )
    return tuple(commit_rule.sized_group(req.group_digest, req.group_size))


def bounded(report: ReportRecord, bounds: ReportBounds) -> ReportRecord:
    """``report`` with each figure within ``bounds``: counts in [0, bound], times in [0, the round's length], a
    loss finite in [0, MAX_LOSS] or NaN, and the run's parameter count in place of the one it says."""
    max_bytes = BYTES_PER_PARAMETER * bounds.param_count if bounds.param_count > 0 else MAX_COUNT
    fixed = dataclasses.replace(
        report,
        inner_steps=_within(report.inner_steps, bounds.inner_steps),
        samples=_within(report.samples, bounds.samples),
        inner_time_s=_seconds(report.inner_time_s, bounds.seconds),
        exchange_time_s=_seconds(report.exchange_time_s, bounds.seconds),
        bytes_sent=_within(report.bytes_sent, max_bytes),
        bytes_received=_within(report.bytes_received, max_bytes),
        loss=report.loss if finite(report.loss) and 0 <= report.loss <= MAX_LOSS else math.nan,
        param_count=bounds.param_count or _within(report.param_count, MAX_COUNT),
    )
    if _figures(fixed) != _figures(report):
        logger.warning(
            "peer %s: round %d: report figures beyond what the round asked were cut to it (steps %d, "
            "samples %d, %.0fs, %d bytes)",
            report.peer_id,
            report.round,
            bounds.inner_steps,
            bounds.samples,
            bounds.seconds,
            max_bytes,
        )
    return fixed


def _figures(report: ReportRecord) -> tuple:
    """What ``bounded`` may cut, to tell whether it did (NaN losses compare equal here)."""
    return (
        report.inner_steps,
        report.samples,
        report.inner_time_s,
        report.exchange_time_s,
        report.bytes_sent,
        report.bytes_received,
        report.loss if finite(report.loss) else None,
    )


def _within(value: int, bound: int) -> int:
    return min(max(int(value), 0), int(bound))


def _seconds(value: float, bound: float) -> float:
    return min(max(value, 0.0), bound) if finite(value) else 0.0
