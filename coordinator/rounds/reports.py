"""The open round's reports: as the peers sent them, kept in the store, and as the commit rule reads them."""

from __future__ import annotations

from typing import Mapping, Optional

from coordinator.rounds import offline_votes, outcome
from coordinator.store.database import Store
from coordinator.store.records import PeerRecord, ReportRecord, RoundRecord
from swarm.core import commit_rule
from swarm.core.round_vote import Vote
from swarm.v1 import coordinator_pb2 as pb


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

    def adopt(self, round_row: RoundRecord, votes: Mapping[str, Vote], *, reporter: str,
              peers: Mapping[str, PeerRecord], now: float) -> RoundRecord:
        """The open round as the group that decided it by ``votes`` had it, the votes of its members whose process
        is gone kept as their reports (``coordinator.rounds.offline_votes``); ``round_row`` itself when nothing changed."""
        if not votes:
            return round_row
        adopted, stand_ins = offline_votes.adopt(round_row, self._reports, votes, reporter=reporter, peers=peers,
                                                 now=now)
        for stand_in in stand_ins:
            self.add(stand_in)
        return adopted

    def by_peer_id(self) -> list[ReportRecord]:
        return sorted(self._reports.values(), key=lambda r: r.peer_id)


def report_record(req: pb.ReportRoundRequest, now: float) -> ReportRecord:
    """The report ``req`` makes, as received at ``now``."""
    return ReportRecord(
        round=req.round, peer_id=req.peer_id, reported_at=now, ok=req.ok,
        state_hash=req.state_hash,
        group=tuple(req.group), samples=req.samples, inner_steps=req.inner_steps,
        inner_time_s=req.inner_time_s, exchange_time_s=req.exchange_time_s, bytes_sent=req.bytes_sent,
        bytes_received=req.bytes_received, loss=req.loss, error=req.error, param_count=req.param_count,
    )
