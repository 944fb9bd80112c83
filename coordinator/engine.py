"""The coordinator's logic in one place: membership and round decisions applied to the store.

Every public method takes one lock, reads the injected clock once, evicts expired peers, does its
work with the pure functions of ``admission``, ``membership`` and ``rounds``, retries the round
decision, and saves the result in one SQLite transaction.  Refusals are ``coordinator.api.errors.Rejection``s.

A heartbeat's cost does not grow with the number of peers: expiries come off a heap (``Roster``), the
round is decided again only when something it depends on changed or its deadline passed (its reports'
claims kept made by ``RoundReports``), the RoundInfo answer is rebuilt only when the round or the peers
it lists changed (``RoundInfoCache``), and a peer record whose only news is its lease and its counters
is written only every few seconds (``PeerWrites``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterator, Optional

from coordinator import membership
from coordinator.api import admission, tokens
from coordinator.api.errors import BadRequest, PeerGone, Rejection, UnknownPeer
from coordinator.api.load import LoadMonitor
from coordinator.api.views import (
    GONE_LISTED_S,
    RunPosition,
    listed_in_status,
    page_request,
    round_info,
    status_response,
)
from coordinator.pace import Pace, PaceConfig, pace_for
from coordinator.roster import Roster
from coordinator.rounds import offline_votes, opening, outcome
from coordinator.rounds.info_cache import RoundInfoCache
from coordinator.rounds.reports import ReportBounds, RoundReports, report_bounds, report_record
from coordinator.store.database import Store
from coordinator.store.history import history_page, int64
from coordinator.store.peer_writes import PeerWrites
from coordinator.store.records import COMMITTED, OPEN, PeerRecord, ReportRecord, RoundRecord, RunRecord, to_json
from coordinator.store.run_log import open_run_log
from coordinator.store.run_open import open_run
from swarm.config import RunConfig
from swarm.control import signing
from swarm.core import credential
from swarm.core.credential import peer_id_for
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


class CoordinatorEngine:
    def __init__(
        self,
        store: Store,
        *,
        config: Optional[RunConfig],
        check_config: bool = True,
        lease_s: float = 15.0,
        heartbeat_interval_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        signing_key: Optional[credential.PeerKey] = None,
        credential_ttl_s: float = admission.CREDENTIAL_TTL_S,
        max_rounds: Optional[int] = None,
        load: Optional[LoadMonitor] = None,
    ) -> None:
        """Open the run kept in ``store``, or start a new one with ``config``.

        Raises ConfigError when the store holds a run with a different config (unless ``check_config``
        is False: the config is a default, not the user's choice, and the stored one wins), or when the
        store holds no run and no config is given. ``max_rounds`` (the command line's --max-rounds) sets a kept
        run's max_rounds even so: a larger one extends it (``run_open.open_run``).

        ``heartbeat_interval_s`` and ``lease_s`` are a small swarm's; a larger one's stretch (``coordinator.pace``),
        and so do they while ``load`` (the gRPC server's, if any) says the coordinator is saturated, which also
        pauses evictions for missed leases.
        """
        self._store = store
        self._pace_config = PaceConfig(heartbeat_interval_s=heartbeat_interval_s, lease_s=lease_s)
        self._server_load = load
        self._logged_interval_s = heartbeat_interval_s  # the interval last logged (a change of 25% is logged)
        self._paused_since: Optional[float] = None  # evictions for missed leases paused: the server is saturated
        self.eviction_pauses = 0  # how often, since the start
        self._clock = clock
        self._lock = threading.RLock()
        self._signing_key = signing_key or credential.PeerKey.generate()
        self._credential_ttl_s = credential_ttl_s
        self.started_at = clock()
        self.config: RunConfig = open_run(store, config, check_config=check_config, now=self.started_at,
                                             max_rounds=max_rounds)
        self.run_log = open_run_log(store, self.config)  # [logging]: the run's curves, as rounds are recorded
        self._load()
        # the group that may have gone on while this coordinator was down: its votes may add them to a round
        self._outage_group = offline_votes.outage_group(self._latest, self._peers)
        self.serving()  # peers kept training while the coordinator was down: a fresh lease to check in

    def _load(self) -> None:
        self._run: RunRecord = self._store.get_run()  # type: ignore[assignment]
        self._latest: Optional[RoundRecord] = self._store.latest_round()
        self._open: Optional[RoundRecord] = (
            self._latest if self._latest is not None and self._latest.outcome == OPEN else None
        )
        self._last_committed: Optional[RoundRecord] = self._store.latest_committed_round()
        self._roster = Roster(self._store.peers(), committed_round=self._last_committed_state()[0],
                              committed_hash=self._last_committed_state()[1])
        self._peers: dict[str, PeerRecord] = self._roster.peers  # read here; written through _save_peer only
        self._writes = PeerWrites()
        self._reports = RoundReports(self._store, self._open.round if self._open is not None else None)
        self._rounds_version = 0  # bumped by every change of a round or of the run
        self._settled: Optional[tuple[int, int, int]] = None  # roster, rounds and reports versions last settled
        self._wait_until = float("inf")  # when the open round is decided even if nothing else happens
        self._info_cache = RoundInfoCache(self._roster)
        self._history = self.run_log.history(self._store)

    def serving(self) -> None:
        """Every live peer's lease runs from now (``membership.RESTART_GRACE_S`` more): call it as the server starts
        to answer, which after a restart is seconds after the store was loaded (the DHT node, TLS)."""
        with self._lock, self._store.transaction():
            for peer in membership.restart_leases(self._peers.values(), now=self._clock(), lease_s=self.lease_s):
                self._save_peer(peer)

    @property
    def run(self) -> RunRecord:
        return self._run

    @property
    def lease_s(self) -> float:
        """The lease a call renews now: the pace's for the live peers."""
        return self.pace().lease_s

    def pace(self) -> Pace:
        """How often the peers are asked to heartbeat and poll now, and their lease (``coordinator.pace``)."""
        with self._lock:
            return self._paced()

    def _paced(self) -> Pace:
        pace = pace_for(self._pace_config, self._roster.live, self._server_load.slowdown() if self._server_load else 1.0)
        if abs(pace.heartbeat_interval_s - self._logged_interval_s) >= 0.25 * self._logged_interval_s:
            self._logged_interval_s = pace.heartbeat_interval_s
            logger.info("pace for %d live peers: a heartbeat every %.1fs, a lease of %.0fs, polls at most every %.1fs",
                        self._roster.live, pace.heartbeat_interval_s, pace.lease_s, pace.poll_interval_s)
        self.last_pace = pace  # read without the lock (the dashboard's /metrics)
        return pace

    # --- requests -------------------------------------------------------------------------------

    def join(
        self, token: str, *, public_key: bytes, dht_peer_id: str = "", name: str = "", site: str = "",
        device: str = "", swarm_version: str = "",
    ) -> tuple[PeerRecord, pb.RoundInfo]:
        """Admit the holder of ``public_key`` (proven by the caller). A key seen before is the same peer
        restarted: it keeps its id and index and starts a new session, which retires the old process."""
        with self._session() as now:
            previous = self._peers.get(peer_id_for(public_key))
            run, peer = admission.admit(
                self._store, self._run, token, public_key=public_key, previous=previous, now=now, lease_s=self.lease_s,
                dht_peer_id=dht_peer_id, name=name, site=site, device=device, swarm_version=swarm_version,
            )
            self._save_run(run)
            self._save_peer(peer)
            logger.info("peer %s: joined as index %d, session %d (name %r, site %r, device %r)", peer.peer_id,
                        peer.peer_index, peer.session, peer.name, peer.site, peer.device)
            if previous is not None:
                self._retire_from_open_round(peer.peer_id, now)
            return peer, self._current_info(peer.peer_id)

    def authenticate(self, proof: Optional[signing.CallProof], peer_id: str) -> None:
        """Raise unless ``proof`` is a fresh signature by the key of ``peer_id`` (the request's peer id) in
        its current session."""
        with self._lock:
            peer = admission.check_caller(proof, peer_id, self._peers.get(peer_id), now=self._clock())
            reason = admission.revocation(self._store, peer)
            if reason is not None:
                with self._session() as now:
                    self._save_peer(membership.evict(peer, reason))
                    logger.warning("peer %s: evicted: %s", peer_id, reason)
                    self._settle(now)
                raise PeerGone(f"peer {peer_id} was evicted: {reason}; ask the operator for a new join string.")

    def issue_credential(self, peer_id: str, *, renew_only: bool = False) -> bytes:
        """A credential for the live member ``peer_id``; with ``renew_only``, b"" unless less than half of
        its current one's life is left."""
        with self._session() as now:
            peer = self._peers.get(peer_id)
            if not admission.credential_due(peer, now, ttl_s=self._credential_ttl_s, renew_only=renew_only):
                return b""
            peer, signed = admission.issue_credential(self._signing_key, self._run.run_id, peer, now=now,
                                                      ttl_s=self._credential_ttl_s)
            self._save_peer(peer)
            return signed

    @property
    def public_key(self) -> bytes:
        """The coordinator's Ed25519 key, which signs the members' credentials."""
        return self._signing_key.public_key

    def heartbeat(self, hb: pb.HeartbeatRequest) -> pb.RoundInfo:
        with self._session() as now:
            peer = membership.check_member(hb.peer_id, self._peers.get(hb.peer_id))
            result = membership.apply_heartbeat(self._run, peer, hb, now=now, lease_s=self.lease_s)
            self._save_run(result.run)
            self._save_peer(result.peer)
            if result.rejection is not None:
                logger.warning("peer %s: evicted: %s", hb.peer_id, result.rejection)
                self._settle(now)
                raise result.rejection
            self._history.record_eval(hb.peer_id, hb.metrics.eval_round, hb.metrics.eval_loss)
            self._settle(now)
            return self._current_info(hb.peer_id, own_only=True)

    def leave(self, peer_id: str, reason: str = "") -> None:
        with self._session() as now:
            peer = self._peers.get(peer_id)
            if peer is None:
                raise UnknownPeer(peer_id)
            if not peer.alive:
                return  # leaving twice is fine
            self._save_peer(membership.leave(peer, reason))
            logger.info("peer %s: left (%s)", peer_id, reason or "no reason given")
            self._settle(now)

    def report(self, req: pb.ReportRoundRequest) -> pb.RoundInfo:
        votes = offline_votes.checked_votes(req, run_id=self._run.run_id, coordinator_public_key=self.public_key,
                                            now=self._clock()) if req.group_votes else {}  # outside the lock
        with self._session() as now:
            peer = membership.check_member(req.peer_id, self._peers.get(req.peer_id))
            if req.round < 1:
                raise BadRequest(f"round {req.round} cannot be reported; rounds are numbered from 1.")
            self._save_peer(membership.with_links(membership.touch(peer, now, self.lease_s), req))
            if self._open is None or req.round != self._open.round:
                return self._info(req.round, req.peer_id)  # late or early: nothing to decide, say how it stands
            report = report_record(req, now, self._report_bounds(req.peer_id, now))
            adopted = self._reports.adopt(self._open, votes, reporter=req.peer_id, peers=self._peers, now=now,
                                          outage=self._outage_group)
            if adopted is not self._open:  # the group decided this round during an outage, with other members
                self._save_round(adopted)
            if self._reports.add(report):
                log = logger.info if req.ok else logger.warning
                log("peer %s: round %d: reported %s%s", req.peer_id, req.round,
                    f"hash {report.state_hash[:12]}" if req.ok else "failure",
                    f" ({req.error})" if req.error else "")
            self._settle(now)
            return self._current_info(req.peer_id)

    def _report_bounds(self, peer_id: str, now: float) -> ReportBounds:
        """What the open round asked of ``peer_id``: its report's figures are cut to it."""
        last_committed = self._last_committed.round if self._last_committed is not None else 0
        return report_bounds(self._open, peer_id, self.config, now=now, param_count=self._run.param_count,
                             rounds_covered=self._open.round - last_committed)

    def round_info(self, peer_id: str, number: int) -> pb.RoundInfo:
        return pb.RoundInfo.FromString(self.round_info_encoded(peer_id, number))

    def round_info_encoded(self, peer_id: str, number: int) -> bytes:
        """Round ``number`` (0: the current one) as ``peer_id`` asks for it, encoded: most of it a cached
        encoding, so the answer's cost hardly grows with the round's participants (``RoundInfoCache.encoded``)."""
        with self._session():
            membership.check_member(peer_id, self._peers.get(peer_id))
            if number < 0:
                raise BadRequest(f"round {number} does not exist; ask for round 0 (the current one) or later.")
            row = self._open or self._latest if number == 0 else None

            def build() -> pb.RoundInfo:
                if number == 0:
                    return round_info(row.round if row else 0, row, self._position(), self._peers)
                return round_info(number, self._store.get_round(number), self._position(), self._peers)

            return self._info_cache.encoded(self._versions()[:2], number, build, requester=peer_id,
                                            poll_interval_s=self._paced().poll_interval_s)

    def status(self, token: str, *, page_size: Optional[int] = None, page_token: str = "") -> pb.GetStatusResponse:
        """The run's status with one page of its peers (``page_size`` of them from ``page_token``, as a GetStatus
        request asks; None: every peer), at a cost that grows with the page, not with the swarm."""
        from_index, size = page_request(page_size or 0, page_token) if page_size is not None else (0, len(self._peers))
        with self._session() as now:
            tokens.check_watcher(self._store, token, now=now)
            page, next_index = self._roster.page(from_index, size, lambda p: listed_in_status(p, now))
            facts = dict(  # records are immutable: the answer is built after the lock is released
                run=self._run, config=self.config, peers=page, position=self._position(holders=False),
                last_committed=self._last_committed,
                rounds_committed=self._store.count_rounds(COMMITTED),
                rounds_voided=self._store.count_rounds(pb.ROUND_OUTCOME_VOIDED),
                now=now, started_at=self.started_at, latest=self._latest, summed=dict(self._roster.sums),
                peers_omitted=self._roster.gone_before(now - GONE_LISTED_S),
                next_page_token=str(next_index) if next_index >= 0 else "",
            )
        return status_response(**facts)

    def history(self, token: str, *, after_round: int = 0, max_rounds: int = 0) -> pb.GetHistoryResponse:
        with self._session() as now:
            tokens.check_watcher(self._store, token, now=now)
        return history_page(self._store, after_round=after_round, max_rounds=max_rounds)

    def tick(self) -> None:
        """Evict expired peers and decide rounds that timed out; call it every fraction of a second."""
        with self._session():
            pass

    def done(self, *, linger_s: float = 20.0) -> bool:
        """The run finished, the final round's participants left and no live peer is still behind, downloading
        the final state (it asks this coordinator for holders, and then leaves too); or ``linger_s`` passed."""
        with self._lock:
            if self._run.finished_at is None:
                return False
            if self._clock() - self._run.finished_at >= linger_s:
                return True
            final = self._latest.participants if self._latest is not None else ()
            if any(self._peers[p].alive for p in final if p in self._peers):
                return False
            return self._roster.behind == 0

    def remember_ports(self, *, grpc_port: int, dht_port: int) -> None:
        """Keep the bound ports, which a restart binds again so that peers' addresses still hold."""
        with self._lock:
            if (self._run.grpc_port, self._run.dht_port) != (grpc_port, dht_port):
                self._save_run(dataclasses.replace(self._run, grpc_port=grpc_port, dht_port=dht_port))

    def peer_dht_addresses(self) -> list[str]:
        """The DHT addresses of the peers not known to be gone: a restarted coordinator's DHT node dials
        them, so the overlay the peers kept up meanwhile and the peers that join through it are one."""
        with self._lock:
            return [m for p in self._peers.values() if p.alive for m in p.metrics.dht_maddrs]

    def is_live_member(self, dht_peer_id: str) -> bool:
        """Whether a libp2p id is a live member's (proven at its join): the relay forwards between those only."""
        with self._lock:
            return any(p.alive and p.dht_peer_id == dht_peer_id for p in self._peers.values())

    # --- internals ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self) -> Iterator[float]:
        """Lock, one clock reading, one transaction; a Rejection is raised after the commit."""
        with self._lock:
            now = self._clock()
            rejection: Optional[Rejection] = None
            try:
                with self._store.transaction():
                    self._evict_expired(now)
                    self._settle(now)
                    try:
                        yield now
                    except Rejection as e:
                        rejection = e  # its state changes (an eviction) must still be saved
            except BaseException:
                self._load()  # the transaction rolled back; forget what memory holds beyond it
                raise
            if rejection is not None:
                raise rejection

    def _retire_from_open_round(self, peer_id: str, now: float) -> None:
        """A restarted peer lost the round it was in, unless its new process still takes part: a placeholder
        failure stands for it, which its own report replaces, and which counts only ``report_grace_s`` after the
        restart, so the round neither waits for a report that never comes nor is voided before it comes."""
        if self._open is not None and peer_id in self._open.participants:
            self._reports.add(ReportRecord(round=self._open.round, peer_id=peer_id, reported_at=now,
                                           error=outcome.RESTARTED))
        self._settle(now)

    def _evict_expired(self, now: float) -> None:
        """Evict the peers whose lease ran out, unless the server is saturated: their heartbeats may be among the
        calls it queued or refused. Once it is not, every live peer has a full lease from then on."""
        if self._server_load is not None and self._server_load.overloaded():
            if self._paused_since is None:
                self._paused_since = now
                self.eviction_pauses += 1
                logger.warning("coordinator saturated: no peer is evicted for a missed lease until it is not")
            return
        if self._paused_since is not None:
            lease_s = self.lease_s
            for peer in membership.renewed_leases(self._peers.values(), until=now + lease_s):
                self._save_peer(peer)
            logger.warning("coordinator no longer saturated after %.0fs: every live peer's lease runs %.0fs from now",
                           now - self._paused_since, lease_s)
            self._paused_since = None
        for peer in self._roster.expired(now):
            evicted = membership.evict(peer, f"no heartbeat for {now - peer.last_seen:.0f}s")
            self._save_peer(evicted)
            logger.warning("peer %s: evicted: %s", peer.peer_id, evicted.gone_reason)

    def _settle(self, now: float) -> None:
        """Decide the open round if it can be, admit late peers, open the next round when possible.

        Does nothing when nothing it depends on changed since the last time and no deadline passed.
        """
        if self._settled == self._versions() and now < self._wait_until:
            return
        self._settle_now(now)
        self._settled = self._versions()

    def _versions(self) -> tuple[int, int, int]:
        return self._roster.version, self._rounds_version, self._reports.version

    def _settle_now(self, now: float) -> None:
        self._wait_until = float("inf")
        if self._open is not None:
            reports = self._reports.by_peer_id()
            alive = self._roster.alive_ids
            look_again = self._leave_out_late(now, reports)
            decision = outcome.decide_round(
                now, self._open, alive, reports, self.config.rounds.round_timeout_s,
                report_grace_s=self.config.rounds.report_grace_s, param_count=self._run.param_count,
                claims=self._reports.claims,
            )
            if not decision.decided:
                self._wait_until = min(decision.wait_until, look_again)
                admitted = opening.admit_late(now, self._open, reports, ready=self._roster.ready_ids(),
                                                    alive=alive, peers=self._peers, config=self.config)
                if admitted is not self._open:
                    self._save_round(admitted)
                return
            self._apply(decision, now)
        if self._run.finished:
            return
        number = (self._latest.round if self._latest is not None else 0) + 1
        planned, wait_until = opening.open_next(
            now, number, ready=self._roster.ready_ids(), carried=self._carried(), config=self.config,
            peers=self._peers, param_count=self._run.param_count, previous=self._latest)
        if planned is not None:
            self._save_round(planned)
            self._wait_until = wait_until

    def _leave_out_late(self, now: float, reports) -> float:
        row, look_again = opening.leave_out_late(now, self._open, reports, peers=self._peers, config=self.config,
                                                       started_at=self.started_at)
        if row is not self._open:
            self._save_round(row)
        return look_again

    def _apply(self, decision: outcome.Decision, now: float) -> None:
        decided = decision.round
        self._save_round(decided)
        self._history.record_round(decided, self._reports.by_peer_id(), self._peers, self.config,
                                   ddp_equivalent_bytes=decision.ddp_equivalent_bytes)
        for peer in membership.counted_rounds(self._peers, joined=decision.joined, missed=decision.missed):
            self._save_peer(peer)
        run = dataclasses.replace(  # a sum that saturates: a status built from it stays within an int64
            self._run, ddp_equivalent_bytes=int64(self._run.ddp_equivalent_bytes + decision.ddp_equivalent_bytes)
        )
        if decided.outcome == COMMITTED and outcome.finishes_run(
            decided, self._store.count_rounds(COMMITTED), self.config.rounds.max_rounds
        ):
            run = dataclasses.replace(run, finished_at=now)
            logger.info("run %s: finished after round %d", run.run_id, decided.round)
        self._save_run(run)
        logger.info("round %d: %s", decided.round, decided.reason)

    def _last_committed_state(self) -> tuple[int, str]:
        if self._last_committed is not None:
            return self._last_committed.round, self._last_committed.committed_hash
        return 0, self._run.initial_hash

    def _carried(self) -> list[str]:
        """The last committed round's holders still alive: they hold its state without saying so yet."""
        if self._last_committed is None:
            return []
        return [p for p in self._last_committed.holders if p in self._peers and self._peers[p].alive]

    def _position(self, *, holders: bool = True) -> RunPosition:
        """Where the run stands; ``holders=False`` leaves out the state holders (status does not show them)."""
        last_round, last_hash = self._last_committed_state()
        return RunPosition(
            last_committed_round=last_round,
            last_committed_hash=last_hash,
            open_round=self._open.round if self._open is not None else 0,
            finished=self._run.finished,
            state_holders=tuple(dict.fromkeys(self._carried() + self._roster.ready_ids())) if holders else (),
        )

    def _current_info(self, requester: str, *, own_only: bool = False) -> pb.RoundInfo:
        """The open round, or the latest decided one when none is open (round 0 before any), as ``requester`` (a
        peer id) gets it: a bounded sample of the holders (``views.holder_sample``) and the pace of polls; a heartbeat's
        answer (``own_only``) names only the requester of the participants (``RoundInfoCache``)."""
        versions = self._versions()[:2]  # reports do not change it
        info = self._info_cache.current(versions, self._open or self._latest, self._position, self._peers,
                                        requester=requester, own_only=own_only)
        info.poll_interval_s = self.pace().poll_interval_s
        return info

    def _info(self, number: int, requester: str) -> pb.RoundInfo:
        def build() -> pb.RoundInfo:
            row = self._store.get_round(number) if number > 0 else None
            return round_info(number, row, self._position(), self._peers)

        info = self._info_cache.of_round(self._versions()[:2], number, build, requester=requester)
        info.poll_interval_s = self.pace().poll_interval_s
        return info

    def _save_run(self, run: RunRecord) -> None:
        if run is not self._run and to_json(run) != to_json(self._run):  # not ==: NaN fields never compare equal
            self._store.put_run(run)
            self._run = run
            self._rounds_version += 1
            self._roster.set_committed(*self._last_committed_state())  # the initial hash may have arrived

    def _save_peer(self, peer: PeerRecord) -> None:
        """Keep ``peer``; write it now unless only its lease and counters changed and were written lately."""
        if self._writes.due(self._peers.get(peer.peer_id), peer):
            self._store.put_peer(peer)
        self._roster.put(peer)

    def _save_round(self, row: RoundRecord) -> None:
        self._store.put_round(row)
        if self._latest is None or row.round >= self._latest.round:
            self._latest = row
        if row.outcome == OPEN and (self._open is None or self._open.round != row.round):
            self._reports = RoundReports(self._store)
        self._open = row if row.outcome == OPEN else None
        if row.outcome == COMMITTED:
            self._last_committed = row
        self._rounds_version += 1
        self._roster.set_committed(*self._last_committed_state())

