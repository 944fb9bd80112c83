"""The coordinator's logic in one place: membership and round decisions applied to the store.

Every public method takes one lock, reads the injected clock once, evicts expired peers, does its work with the
pure functions of ``admission``, ``membership`` and ``rounds``, retries the round decision, and saves the result in
one SQLite transaction. Refusals are ``coordinator.api.errors.Rejection``s. What memory holds of the run is a
``RunState``, saved through it.

A call's cost does not grow with the number of peers: expiries come off a heap (``Roster``); ``RoundSettler``
decides again only when something the round depends on changed or its deadline passed, in a large round at most once
a second on account of reports; the RoundInfo answer is rebuilt only when the round or the peers it lists changed
(``RoundInfoCache``); a peer record whose only news is its lease and its counters is written every few seconds
(``PeerWrites``); a large decided round's history is written a part per call (``RoundRecorder``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
import threading
import time
from typing import Callable, Iterator, Optional

from coordinator import membership
from coordinator.api import admission, tokens
from coordinator.api.errors import BadRequest, PeerGone, Rejection, UnknownPeer
from coordinator.api.load import LoadMonitor
from coordinator.api.views import listed_in_status, page_request, status_response
from coordinator.pace import Pace, PaceConfig, Pacer
from coordinator.rounds import offline_votes
from coordinator.rounds.info_cache import RoundInfoCache
from coordinator.rounds.recording import RoundRecorder
from coordinator.rounds.run_state import RunState
from coordinator.rounds.settling import RoundSettler
from coordinator.store.database import Store
from coordinator.store.history import history_page
from coordinator.store.records import PeerRecord, RunRecord
from coordinator.store.run_log import open_run_log
from coordinator.store.run_open import open_run
from swarm.config import RunConfig
from swarm.control import signing
from swarm.core.trust import credential
from swarm.core.trust.credential import peer_id_for
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)
_JOINED = operator.attrgetter("peer_id", "peer_index", "session", "name", "site", "device")  # a join's log line


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
        self._pacer = Pacer(PaceConfig(heartbeat_interval_s=heartbeat_interval_s, lease_s=lease_s))
        self._server_load = load
        self._sweep = membership.LeaseSweep()  # evictions for missed leases, paused while the server is saturated
        self._clock = clock
        self._lock = threading.RLock()
        self._signing_key = signing_key or credential.PeerKey.generate()
        self._credential_ttl_s = credential_ttl_s
        self.started_at = clock()
        self.config: RunConfig = open_run(
            store, config, check_config=check_config, now=self.started_at, max_rounds=max_rounds
        )
        self.run_log = open_run_log(store, self.config)  # [logging]: the run's curves, as rounds are recorded
        self._load()
        # the group that may have gone on while this coordinator was down: its votes may add them to a round
        self._outage_group = offline_votes.outage_group(self._state.latest, self._state.peers)
        self.serving()  # peers kept training while the coordinator was down: a fresh lease to check in

    def _load(self) -> None:
        self._state = RunState(self._store)
        self._info_cache = RoundInfoCache(self._state)
        self._history = self.run_log.history(self._store)
        self._recorder = RoundRecorder(self._history, self._store, self._state.peers, self.config)
        self._recorder.resume(param_count=self._state.run.param_count)
        self._settler = RoundSettler(self._state, self.config, self._recorder, started_at=self.started_at)

    def serving(self) -> None:
        """Every live peer's lease runs from now (``membership.RESTART_GRACE_S`` more): call it as the server starts
        to answer, which after a restart is seconds after the store was loaded (the DHT node, TLS)."""
        with self._lock, self._store.transaction():
            for peer in membership.restart_leases(self._state.peers.values(), now=self._clock(), lease_s=self.lease_s):
                self._state.save_peer(peer)

    @property
    def run(self) -> RunRecord:
        return self._state.run

    @property
    def eviction_pauses(self) -> int:
        """How often evictions for missed leases were paused, since the start."""
        return self._sweep.pauses

    @property
    def lease_s(self) -> float:
        """The lease a call renews now: the pace's for the live peers."""
        return self.pace().lease_s

    def pace(self) -> Pace:
        """How often the peers are asked to heartbeat and poll now, and their lease (``coordinator.pace``)."""
        with self._lock:
            return self._paced()

    def _paced(self) -> Pace:
        return self._pacer.pace(self._state.roster.live, self._server_load.slowdown() if self._server_load else 1.0)

    @property
    def last_pace(self) -> Pace:
        """The pace last asked for, read without the lock (the dashboard's /metrics)."""
        return self._pacer.last

    # --- requests -------------------------------------------------------------------------------

    def join(
        self,
        token: str,
        *,
        public_key: bytes,
        dht_peer_id: str = "",
        name: str = "",
        site: str = "",
        device: str = "",
        swarm_version: str = "",
    ) -> tuple[PeerRecord, pb.RoundInfo]:
        """Admit the holder of ``public_key`` (proven by the caller). A key seen before is the same peer
        restarted: it keeps its id and index and starts a new session, which retires the old process."""
        with self._session() as now:
            previous = self._state.peers.get(peer_id_for(public_key))
            run, peer = admission.admit(
                self._store,
                self._state.run,
                token,
                public_key=public_key,
                previous=previous,
                now=now,
                lease_s=self.lease_s,
                dht_peer_id=dht_peer_id,
                name=name,
                site=site,
                device=device,
                swarm_version=swarm_version,
            )
            self._state.save_run(run)
            self._state.save_peer(peer)
            logger.info("peer %s: joined as index %d, session %d (name %r, site %r, device %r)", *_JOINED(peer))
            if previous is not None:
                self._retire_from_open_round(peer.peer_id, now)
            return peer, self._current_info(peer.peer_id, now)

    def authenticate(self, proof: Optional[signing.CallProof], peer_id: str) -> None:
        """Raise unless ``proof`` is a fresh signature by the key of ``peer_id`` (the request's peer id) in
        its current session."""
        with self._session() as now:
            self._check_caller(proof, peer_id, now)

    def _check_caller(self, proof: Optional[signing.CallProof], peer_id: str, now: float) -> None:
        """``authenticate`` within a session; a member whose token was revoked is evicted (saved with the session)."""
        peer = admission.check_caller(proof, peer_id, self._state.peers.get(peer_id), now=now)
        reason = admission.revocation(self._store, peer)
        if reason is not None:
            self._state.save_peer(membership.evict(peer, reason))
            logger.warning("peer %s: evicted: %s", peer_id, reason)
            self._settler.settle(now)
            raise PeerGone(f"peer {peer_id} was evicted: {reason}; ask the operator for a new join string.")

    def issue_credential(self, peer_id: str, *, renew_only: bool = False) -> bytes:
        """A credential for the live member ``peer_id``; with ``renew_only``, b"" unless less than half of
        its current one's life is left."""
        with self._session() as now:
            return self._credential(peer_id, now, renew_only=renew_only)

    def _credential(self, peer_id: str, now: float, *, renew_only: bool) -> bytes:
        peer = self._state.peers.get(peer_id)
        if not admission.credential_due(peer, now, ttl_s=self._credential_ttl_s, renew_only=renew_only):
            return b""
        peer, signed = admission.issue_credential(
            self._signing_key, self._state.run.run_id, peer, now=now, ttl_s=self._credential_ttl_s
        )
        self._state.save_peer(peer)
        return signed

    @property
    def public_key(self) -> bytes:
        """The coordinator's Ed25519 key, which signs the members' credentials."""
        return self._signing_key.public_key

    def heartbeat(self, hb: pb.HeartbeatRequest) -> pb.RoundInfo:
        with self._session() as now:
            return self._heartbeat(hb, now)

    def signed_heartbeat(self, hb: pb.HeartbeatRequest, proof: Optional[signing.CallProof]) -> pb.HeartbeatResponse:
        """A member's Heartbeat call whole, in one session (one lock, one clock reading, one transaction): its
        signature checked (``authenticate``), the heartbeat applied, the answer with the pace and, when due, a renewed
        credential."""
        with self._session() as now:
            self._check_caller(proof, hb.peer_id, now)
            info = self._heartbeat(hb, now)
            pace = self._paced()
            return pb.HeartbeatResponse(
                round=info,
                lease_s=pace.lease_s,
                heartbeat_interval_s=pace.heartbeat_interval_s,
                credential=self._credential(hb.peer_id, now, renew_only=True),
            )

    def _heartbeat(self, hb: pb.HeartbeatRequest, now: float) -> pb.RoundInfo:
        peer = membership.check_member(hb.peer_id, self._state.peers.get(hb.peer_id))
        result = membership.apply_heartbeat(self._state.run, peer, hb, now=now, lease_s=self.lease_s)
        self._state.save_run(result.run)
        self._state.save_peer(result.peer)
        if result.rejection is not None:
            logger.warning("peer %s: evicted: %s", hb.peer_id, result.rejection)
            self._settler.settle(now)
            raise result.rejection
        self._history.record_eval(hb.peer_id, hb.metrics.eval_round, hb.metrics.eval_loss)
        self._settler.settle(now)
        return self._current_info(hb.peer_id, now, own_only=True)

    def leave(self, peer_id: str, reason: str = "") -> None:
        with self._session() as now:
            peer = self._state.peers.get(peer_id)
            if peer is None:
                raise UnknownPeer(peer_id)
            if not peer.alive:
                return  # leaving twice is fine
            self._state.save_peer(membership.leave(peer, reason))
            logger.info("peer %s: left (%s)", peer_id, reason or "no reason given")
            self._settler.settle(now)

    def report(self, req: pb.ReportRoundRequest) -> pb.RoundInfo:
        votes = (
            offline_votes.checked_votes(
                req, run_id=self._state.run.run_id, coordinator_public_key=self.public_key, now=self._clock()
            )
            if req.group_votes
            else {}
        )  # outside the lock
        with self._session() as now:
            peer = membership.check_member(req.peer_id, self._state.peers.get(req.peer_id))
            if req.round < 1:
                raise BadRequest(f"round {req.round} cannot be reported; rounds are numbered from 1.")
            self._state.save_peer(membership.with_links(membership.touch(peer, now, self.lease_s), req))
            if self._state.open is None or req.round != self._state.open.round:
                return self._info(req.round, req.peer_id, now)  # late or early: nothing to decide, say how it stands
            self._state.take_report(req, votes, config=self.config, now=now, outage=self._outage_group)
            self._settler.settle(now)
            return self._current_info(req.peer_id, now)

    def round_info(self, peer_id: str, number: int) -> pb.RoundInfo:
        return pb.RoundInfo.FromString(self.round_info_encoded(peer_id, number))

    def round_info_encoded(
        self, peer_id: str, number: int, proof: Optional[signing.CallProof] = None, *, signed: bool = False
    ) -> bytes:
        """Round ``number`` (0: the current one) as ``peer_id`` asks for it, encoded: most of it a cached
        encoding, so the answer's cost does not grow with the swarm (``RoundInfoCache.encoded``). ``signed``: a
        member's call, whose ``proof`` is checked in the same session (``authenticate``)."""
        with self._session() as now:
            if signed:
                self._check_caller(proof, peer_id, now)
            membership.check_member(peer_id, self._state.peers.get(peer_id))
            if number < 0:
                raise BadRequest(f"round {number} does not exist; ask for round 0 (the current one) or later.")
            return self._info_cache.encoded(
                number, requester=peer_id, poll_interval_s=self._paced().poll_interval_s, now=now
            )

    def status(self, token: str, *, page_size: Optional[int] = None, page_token: str = "") -> pb.GetStatusResponse:
        """The run's status with one page of its peers (``page_size`` of them from ``page_token``, as a GetStatus
        request asks; None: every peer), at a cost that grows with the page, not with the swarm."""
        paged = page_size is not None
        from_index, size = page_request(page_size or 0, page_token) if paged else (0, len(self._state.peers))
        with self._session() as now:
            tokens.check_watcher(self._store, token, now=now)
            page, next_index = self._state.roster.page(from_index, size, lambda p: listed_in_status(p, now))
            facts = self._state.status_facts(page, next_index, now=now)
        return status_response(**facts, config=self.config, started_at=self.started_at)  # after the lock is released

    def history(self, token: str, *, after_round: int = 0, max_rounds: int = 0) -> pb.GetHistoryResponse:
        with self._session() as now:
            tokens.check_watcher(self._store, token, now=now)
            self._recorder.write(math.inf)  # every decided round's rows, before they are read
        return history_page(self._store, after_round=after_round, max_rounds=max_rounds)

    def tick(self) -> None:
        """Evict expired peers and decide rounds that timed out; call it every fraction of a second."""
        with self._session():
            pass

    def close(self) -> None:
        """Write what is still unwritten of the decided rounds and close the run's training log; call it last."""
        with self._lock, self._store.transaction():
            self._recorder.write(math.inf)
        self.run_log.close()

    def done(self, *, linger_s: float = 20.0) -> bool:
        """The run finished, the final round's participants left and no live peer is still behind, downloading
        the final state (it asks this coordinator for holders, and then leaves too); or ``linger_s`` passed."""
        with self._lock:
            return self._state.done(now=self._clock(), linger_s=linger_s)

    def remember_ports(self, *, grpc_port: int, dht_port: int) -> None:
        """Keep the bound ports, which a restart binds again so that peers' addresses still hold."""
        with self._lock:
            if (self._state.run.grpc_port, self._state.run.dht_port) != (grpc_port, dht_port):
                self._state.save_run(dataclasses.replace(self._state.run, grpc_port=grpc_port, dht_port=dht_port))

    def peer_dht_addresses(self) -> list[str]:
        """The DHT addresses of the peers not known to be gone, which a restarted coordinator's DHT node dials."""
        with self._lock:
            return self._state.roster.dht_addresses()

    def is_live_member(self, dht_peer_id: str) -> bool:
        """Whether a libp2p id is a live member's (proven at its join): the relay forwards between those only."""
        with self._lock:
            return self._state.roster.is_live_member(dht_peer_id)

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
                    self._settler.settle(now)
                    self._recorder.write()  # a part of a large decided round's rows
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
        self._state.retire_from_open_round(peer_id, now=now)
        self._settler.settle(now)

    def _evict_expired(self, now: float) -> None:
        """Evict the peers whose lease ran out, unless the server is saturated (``membership.LeaseSweep``)."""
        overloaded = self._server_load is not None and self._server_load.overloaded()
        swept = self._sweep.sweep(
            now,
            overloaded=overloaded,
            peers=self._state.peers.values(),
            expired=() if overloaded else self._state.roster.expired(now),
            lease_s=self.lease_s,
        )
        for peer in swept:
            self._state.save_peer(peer)

    def _current_info(self, requester: str, now: float, *, own_only: bool = False) -> pb.RoundInfo:
        """The open round, or the latest decided one when none is open (round 0 before any), as ``requester`` (a
        peer id) gets it (``RoundInfoCache.current``), with the pace of polls."""
        info = self._info_cache.current(requester=requester, own_only=own_only, now=now)
        info.poll_interval_s = self.pace().poll_interval_s
        return info

    def _info(self, number: int, requester: str, now: float) -> pb.RoundInfo:
        """Round ``number`` (from 1) as ``requester`` gets it."""
        info = self._info_cache.of_round(number, requester=requester, now=now)
        info.poll_interval_s = self.pace().poll_interval_s
        return info
