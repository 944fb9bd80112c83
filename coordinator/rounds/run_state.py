"""The run as the engine's memory holds it: the run record, its latest, open and last committed rounds, the
peers (``Roster``) and the open round's reports (``RoundReports``), loaded from the store at once and written back
through ``save_run``, ``save_peer`` and ``save_round``, which keep memory and store the same. Its version counters
say when a decision or a cached answer that depends on them must be made again. Owned by the engine, used under
its lock only; after a rolled back transaction the engine loads a fresh one."""

from __future__ import annotations

import dataclasses
import logging
from typing import AbstractSet, Mapping, Optional, Sequence

from coordinator import membership
from coordinator.api.views import GONE_LISTED_S, RunPosition
from coordinator.roster import Roster
from coordinator.rounds import outcome
from coordinator.rounds.reports import ReportBounds, RoundReports, report_bounds, report_record
from coordinator.store.database import Store
from coordinator.store.history import int64
from coordinator.store.peer_writes import PeerWrites
from coordinator.store.records import (
    COMMITTED,
    OPEN,
    VOIDED,
    PeerRecord,
    ReportRecord,
    RoundRecord,
    RunRecord,
    to_json,
)
from swarm.config import RunConfig
from swarm.core.trust.round_vote import Vote
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


class RunState:
    def __init__(self, store: Store) -> None:
        self._store = store
        self.run: RunRecord = store.get_run()  # type: ignore[assignment]
        self.latest: Optional[RoundRecord] = store.latest_round()
        latest_open = self.latest is not None and self.latest.outcome == OPEN
        self.open: Optional[RoundRecord] = self.latest if latest_open else None
        self.last_committed: Optional[RoundRecord] = store.latest_committed_round()
        self.roster = Roster(
            store.peers(), committed_round=self.last_committed_state()[0], committed_hash=self.last_committed_state()[1]
        )
        self.peers: dict[str, PeerRecord] = self.roster.peers  # read here; written through save_peer only
        self._writes = PeerWrites()
        self.reports = RoundReports(store, self.open.round if self.open is not None else None)
        self.rounds_version = 0  # bumped by every change of a round or of the run
        self._places: tuple[Optional[RoundRecord], dict[str, int]] = (None, {})  # a row, its participants' places

    def versions(self) -> tuple[int, int, int]:
        """The versions of the roster, the rounds (and the run) and the open round's reports."""
        return self.roster.version, self.rounds_version, self.reports.version

    def last_committed_state(self) -> tuple[int, str]:
        if self.last_committed is not None:
            return self.last_committed.round, self.last_committed.committed_hash
        return 0, self.run.initial_hash

    def carried(self) -> list[str]:
        """The last committed round's holders still alive: they hold its state without saying so yet."""
        if self.last_committed is None:
            return []
        return [p for p in self.last_committed.holders if p in self.peers and self.peers[p].alive]

    def position(self, *, holders: bool = True) -> RunPosition:
        """Where the run stands; ``holders=False`` leaves out the state holders (status does not show them)."""
        last_round, last_hash = self.last_committed_state()
        return RunPosition(
            last_committed_round=last_round,
            last_committed_hash=last_hash,
            open_round=self.open.round if self.open is not None else 0,
            finished=self.run.finished,
            state_holders=tuple(dict.fromkeys(self.carried() + self.roster.ready_ids())) if holders else (),
        )

    def round_row(self, number: int) -> Optional[RoundRecord]:
        """Round ``number``'s record (None: not opened yet); the open and the latest round from memory."""
        for row in (self.open, self.latest):
            if row is not None and row.round == number:
                return row
        return self._store.get_round(number)

    def report_bounds(self, peer_id: str, config: RunConfig, *, now: float) -> ReportBounds:
        """What the open round asked of ``peer_id``: its report's figures are cut to it."""
        last_committed = self.last_committed.round if self.last_committed is not None else 0
        if self._places[0] is not self.open:  # each participant's place, kept while the open round's row stays
            self._places = (self.open, {p: i for i, p in enumerate(self.open.participants)})
        return report_bounds(
            self.open,
            peer_id,
            config,
            now=now,
            param_count=self.run.param_count,
            rounds_covered=self.open.round - last_committed,
            places=self._places[1],
        )

    def take_report(
        self,
        req: pb.ReportRoundRequest,
        votes: Mapping[str, Vote],
        *,
        config: RunConfig,
        now: float,
        outage: AbstractSet[str],
    ) -> None:
        """Keep ``req``, a report of the open round received at ``now``, its figures cut to what the round asked
        (``report_bounds``), with the members' offline ``votes`` it carries (``RoundReports.adopt``)."""
        report = report_record(req, now, self.report_bounds(req.peer_id, config, now=now))
        adopted = self.reports.adopt(self.open, votes, reporter=req.peer_id, peers=self.peers, now=now, outage=outage)
        if adopted is not self.open:  # the group decided this round during an outage, with other members
            self.save_round(adopted)
        if self.reports.add(report):
            log = logger.info if req.ok else logger.warning
            log(
                "peer %s: round %d: reported %s%s",
                req.peer_id,
                req.round,
                f"hash {report.state_hash[:12]}" if req.ok else "failure",
                f" ({req.error})" if req.error else "",
            )

    def status_facts(self, page: list[PeerRecord], next_index: int, *, now: float) -> dict:
        """What a status page shows besides the run's config and start (``views.status_response``'s arguments):
        records are immutable, so the answer can be built after the engine's lock is released."""
        return dict(
            run=self.run,
            peers=page,
            position=self.position(holders=False),
            last_committed=self.last_committed,
            rounds_committed=self._store.count_rounds(COMMITTED),
            rounds_voided=self._store.count_rounds(VOIDED),
            now=now,
            latest=self.latest,
            summed=dict(self.roster.sums),
            peers_omitted=self.roster.gone_before(now - GONE_LISTED_S),
            next_page_token=str(next_index) if next_index >= 0 else "",
        )

    def run_after(self, decision: outcome.Decision, *, now: float, max_rounds: Optional[int]) -> RunRecord:
        """The run once ``decision`` (saved) is applied: the bytes a DDP all-reduce would have sent added (a sum
        that saturates, so that a status built from it stays within an int64), and finished at ``now`` if its
        round was the last one to commit."""
        added = int64(self.run.ddp_equivalent_bytes + decision.ddp_equivalent_bytes)
        run = dataclasses.replace(self.run, ddp_equivalent_bytes=added)
        decided = decision.round
        if decided.outcome == COMMITTED and outcome.finishes_run(
            decided, self._store.count_rounds(COMMITTED), max_rounds
        ):
            run = dataclasses.replace(run, finished_at=now)
            logger.info("run %s: finished after round %d", run.run_id, decided.round)
        return run

    def retire_from_open_round(self, peer_id: str, *, now: float) -> None:
        """A placeholder failure for ``peer_id``, restarted at ``now``, if it takes part in the open round."""
        if self.open is not None and peer_id in self.open.participants:
            self.reports.add(
                ReportRecord(round=self.open.round, peer_id=peer_id, reported_at=now, error=outcome.RESTARTED)
            )

    def done(self, *, now: float, linger_s: float) -> bool:
        """The run finished, the final round's participants left and no live peer is still behind; or
        ``linger_s`` passed since it finished (``CoordinatorEngine.done``)."""
        if self.run.finished_at is None:
            return False
        if now - self.run.finished_at >= linger_s:
            return True
        final = self.latest.participants if self.latest is not None else ()
        if any(self.peers[p].alive for p in final if p in self.peers):
            return False
        return self.roster.behind == 0

    def save_run(self, run: RunRecord) -> None:
        if run is not self.run and to_json(run) != to_json(self.run):  # not ==: NaN fields never compare equal
            self._store.put_run(run)
            self.run = run
            self.rounds_version += 1
            self.roster.set_committed(*self.last_committed_state())  # the initial hash may have arrived

    def save_peer(self, peer: PeerRecord) -> None:
        """Keep ``peer``; write it now unless only its lease and counters changed and were written lately."""
        if self._writes.due(self.peers.get(peer.peer_id), peer):
            self._store.put_peer(peer)
        self.roster.put(peer)

    def count_rounds(self, *, joined: Sequence[str], missed: Sequence[str]) -> list[str]:
        """A decided round counted for its participants (``membership.counted_rounds``) in memory; returns the
        peers counted, whose records the caller writes (``RoundRecorder``: a decision in a swarm of thousands does
        not write them all at once)."""
        counted = membership.counted_rounds(self.peers, joined=joined, missed=missed)
        self.roster.recount(counted)
        return [p.peer_id for p in counted]

    def save_round(self, row: RoundRecord) -> None:
        self._store.put_round(row)
        if self.latest is None or row.round >= self.latest.round:
            self.latest = row
        if row.outcome == OPEN and (self.open is None or self.open.round != row.round):
            self.reports = RoundReports(self._store)
        self.open = row if row.outcome == OPEN else None
        if row.outcome == COMMITTED:
            self.last_committed = row
        self.rounds_version += 1
        self.roster.set_committed(*self.last_committed_state())
