"""The peer daemon: join a run, train H inner steps, average pseudo-gradients, commit only what all agree on.

Run it with ``swarm peer --join 'swarm://...'``. One round, from this peer's side:

    hold θg of committed round r−1 → wait to be planned into round r → H inner AdamW steps →
    find the group (DHT) → butterfly-average Δ (bit-identical on every member) → tentative θg' →
    report hash(θg') → the coordinator commits the hash most members hold, or voids the round →
    keep θg' if it is the committed one, else download the committed state from a holder.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from peer import identity
from peer.faults import FaultPlan
from peer.heartbeat import HeartbeatThread
from peer.retry import with_retry
from peer.resume import checkpoint_dir, maybe_resume, prune_votes, save_trainer, save_vote
from peer.stats import PeerStats
from swarm.core.state import state_hash
from swarm.config import RunConfig
from swarm.control.client import CoordinatorClient, CoordinatorRejected, CoordinatorUnreachable
from swarm.net.allreduce import Exchange, ExchangeFailed
from swarm.net.votes import Vote, collect_votes, group_decision, post_vote
from swarm.control.joinstring import JoinString
from swarm.net.rendezvous import Member, group_key, participation_scale, rendezvous
from swarm.net.state_transfer import GlobalState, StateServer, StateUnavailable, download_state
from swarm.core.fragments import round_fragment, round_steps
from swarm.train.trainer import Contribution, LocalTrainer, TrainStats
from swarm.net.transport import Transport, TransportStartFailed
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PeerOptions:
    join: JoinString
    device: str = "cpu"
    state_dir: Path = Path("swarm-peer")
    site: str = ""
    name: str = ""
    threads: Optional[int] = None  # torch intra-op threads; None keeps torch's default
    p2p_host: str = "127.0.0.1"
    p2p_port: int = 0
    announce_host: Optional[str] = None
    poll_s: float = 0.2  # how often a waiting peer asks the coordinator about the round
    state_timeout_s: float = 120.0
    join_timeout_s: float = 120.0  # give up joining when the coordinator stays unreachable this long
    faults: FaultPlan = field(default_factory=FaultPlan)  # deterministic fault injection (tests, chaos)
    checkpoint_every_rounds: int = 5  # 0: never, and votes are not written either (a checkpoint is still
    # written when the peer exits)
    leave_grace_s: float = 10.0  # a leaving peer still waits this long for its round's decision
    final_serve_s: float = 30.0  # after the run, keep serving the final state this long at most while live
    # peers still download it


class PeerExit(Exception):
    """Stop the daemon with this exit code; the message has already been logged."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class PeerDaemon:
    def __init__(self, options: PeerOptions):
        self.options = options
        self.stop = threading.Event()
        self.stats = PeerStats()
        self.client = CoordinatorClient(options.join)
        self.peer_id = ""
        self.transport: Optional[Transport] = None
        self._background: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._offline_next: Optional[int] = None  # next round to run while the coordinator is down
        self._decided_by_group: Optional[int] = None  # the last round the group decided without it
        self._last_group: Optional[set[str]] = None  # the last known plan
        self._live_peers = 0  # the run's live peers, as last heard from the coordinator (0: not yet)
        self._backlog: list[tuple[pb.ReportRoundRequest, Optional[str]]] = []  # group-decided rounds to report
        self.heartbeat: Optional[HeartbeatThread] = None
        self._disk_tried: Optional[int] = None  # the committed round last looked for on this peer's disk
        self._provisional = False  # the state is a round the group decided without the coordinator

    # ---- lifecycle -------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        except PeerExit as e:
            if self.heartbeat is not None and self.heartbeat.rejection:
                logger.error("%s the coordinator rejected this peer: %s", self._tag(), self.heartbeat.rejection)
                return 2
            return e.code
        except CoordinatorRejected as e:
            logger.error("%s the coordinator rejected this peer: %s", self._tag(), e)
            return 2
        finally:
            self._shutdown()

    def _run(self) -> int:
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        previous = identity.previous_peer_id(self.options.state_dir)
        joined = with_retry(
            lambda: self.client.join(site=self.options.site, device=self.options.device,
                                     name=self.options.name or socket.gethostname(), previous_peer_id=previous),
            what="join", stop=self.stop, give_up_after_s=self.options.join_timeout_s,
        )
        if joined is None:
            logger.error("could not reach the coordinator at %s for %.0fs; check the join string's address "
                         "and that the coordinator is running", self.options.join.address, self.options.join_timeout_s)
            raise PeerExit(2)
        self.peer_id = joined.peer_id
        self.run_id = joined.run_id
        self.run_config = RunConfig.from_json(joined.run_spec_json)
        logger.info("%s joined run %s as peer index %d%s", self._tag(), joined.run_id, joined.peer_index,
                    f" (restarted; was {previous})" if previous else "")
        identity.remember(self.options.state_dir, run_id=self.run_id, peer_id=self.peer_id)

        # heartbeats start now: building the model and the transport takes longer than a short lease
        self.heartbeat = HeartbeatThread(self.client, self.peer_id, self.stats, self.stop,
                                         interval_s=joined.heartbeat_interval_s, faults=self.options.faults)
        self.heartbeat.start()
        self.trainer = LocalTrainer(self.run_config, peer_index=joined.peer_index, device=self.options.device)
        # After the model build, not overlapped with it: forked right after the join, gRPC still had
        # threads inside it and peers died silently at start (docs/ARCHITECTURE.md, known limits).
        self.transport = self._start_transport(list(joined.dht_initial_peers))
        self.exchange = Exchange(self.transport, run_id=self.run_id)
        self.state_server = StateServer(self.transport, run_id=self.run_id)
        self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="swarm-exchange")
        self.stats.update(
            model_fingerprint=self.trainer.fingerprint,
            param_count=self.trainer.param_count,
            dht_peer_id=self.transport.peer_id,
            dht_maddrs=tuple(self.transport.visible_maddrs),
        )
        self._commit_state(self.trainer.global_params, self.trainer.momentum, 0)
        if joined.round.last_committed_round == 0:
            self._evaluate()  # the initial loss; a joiner of a run under way resumes or downloads in _sync
        self.heartbeat.beat_now()

        carry: Optional[_Pending] = None
        while not self.stop.is_set():
            if self.heartbeat.rejection:
                logger.error("%s %s", self._tag(), self.heartbeat.rejection)
                return 2
            if carry is not None:  # overlap: the next round starts before the coordinator opens it
                carry = self._run_round(carry.round + 1, carry)
                continue
            try:
                info = self._get_round(0)
            except CoordinatorUnreachable:
                if self._offline_next is not None:  # the group keeps averaging while the coordinator is down
                    carry = self._run_round(self._offline_next, None)
                    continue
                info = self._round_info(0)  # nothing to do without it: wait (with backoff, logged)
            if self._backlog:
                self._flush_backlog()
                continue
            if info.last_committed_round > self.trainer.round:
                if not self._sync(info) and info.finished and not info.holders:  # holders stay a while
                    logger.error("%s the run finished at round %d and no peer holding its state is left to "
                                 "download it from; no final model was written", self._tag(), info.last_committed_round)
                    return 1
                continue
            if info.finished:
                return self._finish()
            if info.open_round and self.peer_id in info.participants and info.round == info.open_round:
                carry = self._run_round(info.open_round, None)
                continue
            self.stats.update(state=pb.PEER_STATE_READY)
            self.stop.wait(self.options.poll_s)  # waiting to be planned into a round
        return 0

    def _start_transport(self, initial_peers: list[str]) -> Transport:
        """Join the DHT through the coordinator's node, retrying while it is unreachable (a coordinator
        restarting as this peer starts: seen in the chaos soak); gives up after join_timeout_s."""
        transport = with_retry(
            lambda: Transport(initial_peers=initial_peers, host=self.options.p2p_host,
                              port=self.options.p2p_port, announce_host=self.options.announce_host),
            what=f"{self._tag()} DHT start", stop=self.stop, give_up_after_s=self.options.join_timeout_s,
            first_backoff_s=1.0, retry_on=TransportStartFailed,
        )
        if transport is None:
            logger.error("%s could not join the DHT through %s for %.0fs; check that the coordinator is running "
                         "and that this machine can reach its DHT port", self._tag(), initial_peers,
                         self.options.join_timeout_s)
            raise PeerExit(2)
        return transport

    def _shutdown(self) -> None:
        self.stop.set()
        if self._background is not None:
            self._background.shutdown(wait=True, cancel_futures=True)
        if getattr(self, "trainer", None) is not None and self.trainer.round > 0 and not self._provisional:
            self._checkpoint()  # a restarted peer resumes here if the run has not moved on
        if self.heartbeat is not None:
            self.heartbeat.beat_now()  # wakes it from its interval wait: it sees stop and ends
            self.heartbeat.join(timeout=5)
        if self.peer_id:
            try:  # a last heartbeat carries the final round's numbers (bytes, eval loss) before leaving
                self.client.heartbeat(self.stats.heartbeat_request(self.peer_id))
            except Exception as e:
                logger.debug("final heartbeat failed: %r", e)
            try:
                self.client.leave(peer_id=self.peer_id, reason="peer exiting")
            except Exception as e:  # leaving is best effort: the lease expires anyway
                logger.debug("leave failed: %r", e)
        if self.transport is not None:
            self.transport.shutdown()
        self.client.close()

    # ---- one round ---------------------------------------------------------------------------------
    def _run_round(self, round_: int, carry: Optional["_Pending"]) -> Optional["_Pending"]:
        """Train round_'s inner steps and start its exchange; returns it still in flight when it overlaps
        the next round's first τ steps (Streaming DiLoCo), else finishes it and returns None.

        carry is the previous round's exchange, still in flight: it is finished after τ steps here.
        """
        run = self.run_config.rounds
        steps = round_steps(round_, run.inner_steps, run.fragments)
        fragment = round_fragment(round_, run.fragments)
        self.stats.update(state=pb.PEER_STATE_TRAINING, round=round_)
        parts = []
        if carry is not None:
            parts.append(self.trainer.train(min(run.overlap_steps, steps)))
            if not self._finish_round(carry):
                return None  # the previous round left this peer behind: the main loop resyncs
            if self._offline_next != round_:
                info = self._round_info(round_)
                if info.outcome != pb.ROUND_OUTCOME_OPEN or self.peer_id not in info.participants:
                    return None  # not planned into this round after all; the main loop decides what next
            parts.append(self.trainer.train(steps - parts[0].steps))
        else:
            parts.append(self.trainer.train(steps))
        train = _combine(parts)
        self.stats.add(inner_time_s=train.inner_time_s, inner_steps=train.steps, tokens=train.tokens)
        self.stats.update(loss=train.mean_loss, step_time_s=train.inner_time_s / max(1, train.steps),
                          tokens_per_s=train.tokens / max(1e-9, train.inner_time_s))
        logger.info("%s trained %d steps, loss %.4f, %.0f tokens/s", self._tag(round_), train.steps,
                    train.mean_loss, train.tokens / max(1e-9, train.inner_time_s))
        self.options.faults.at(round_, "trained")
        if self.stop.is_set():
            return None  # leaving: the group goes on without this peer's contribution

        contribution = self.trainer.take_contribution(fragment)
        self.stats.update(state=pb.PEER_STATE_EXCHANGING)
        self.heartbeat.beat_now()  # closes late admission to this round at the coordinator
        pending = _Pending(round=round_, fragment=fragment, contribution=contribution,
                           future=self._background.submit(self._exchange_and_vote, round_, contribution, train))
        last = self.run_config.rounds.max_rounds is not None and round_ >= self.run_config.rounds.max_rounds
        if run.overlap_steps > 0 and not last:
            return pending  # the exchange runs while the next round's first τ steps train
        self._finish_round(pending)
        return None

    def _exchange_and_vote(self, round_: int, contribution, train) -> "_Outcome":
        """Find the group, average, vote with the tentative state's hash, wait for the decision."""
        tag = self._tag(round_)
        run = self.run_config.rounds
        faults = self.options.faults
        me = Member(peer_id=self.peer_id, dht_peer_id=self.transport.peer_id, index=self.trainer.peer_index,
                    weight=float(contribution.samples), numel=contribution.delta.numel(), codec=run.codec,
                    live_peers=self._live_peers if run.scale_by_participation else 0)
        key = group_key(self.run_id, round_, contribution.fragment)
        ok, error, new_hash, group_ids, sent, received, exchange_s = False, "", "", [], 0, 0, 0.0
        tentative = None
        try:
            if contribution.samples <= 0:
                raise ExchangeFailed(f"{key}: no inner steps since this fragment last synced")
            group = rendezvous(
                self.transport.dht, key=key, me=me, planned=lambda: self._planned(round_),
                window_s=run.matchmaking_window_s, ttl_s=run.matchmaking_window_s + run.exchange_timeout_s,
                on_posted=lambda: faults.at(round_, "matchmaking"),
            )
            group_ids = [m.peer_id for m in group]
            result = self.exchange.average(key=key, group=group, me=me, delta=contribution.delta,
                                           timeout_s=run.exchange_timeout_s,
                                           on_phase=lambda phase: faults.fire(round_, phase))
            sent, received, exchange_s = result.bytes_sent, result.bytes_received, result.seconds
            scale = participation_scale(group)
            average = result.average if scale == 1.0 else result.average * scale
            tentative = self.trainer.apply(average, fragment=contribution.fragment)
            new_hash = state_hash(*tentative)
            ok = True
            self._persist_vote(round_, tentative, new_hash)
            logger.info("%s averaged fragment %d with %d peers in %.2fs (%d bytes sent)%s, tentative hash %s",
                        tag, contribution.fragment, len(group), exchange_s, sent,
                        f", outer step scaled by {scale:.2f} ({len(group)} of {max(m.live_peers for m in group)} "
                        "live peers)" if scale != 1.0 else "", new_hash)
        except ExchangeFailed as e:
            error = str(e)
            logger.warning("%s exchange failed: %s", tag, e)
        self.stats.add(bytes_sent=sent, bytes_received=received)
        faults.at(round_, "averaged")

        request = pb.ReportRoundRequest(
            peer_id=self.peer_id, round=round_, ok=ok, params_hash=new_hash, group=group_ids,
            samples=contribution.samples, inner_steps=train.steps, inner_time_s=train.inner_time_s,
            exchange_time_s=exchange_s, bytes_sent=sent, bytes_received=received, loss=train.mean_loss,
            error=error, param_count=self.trainer.param_count,
        )
        post_vote(self.transport.dht, key, Vote(peer_id=self.peer_id, dht_peer_id=self.transport.peer_id, ok=ok,
                                                params_hash=new_hash), ttl_s=600)
        if faults.drops(round_, "report"):
            faults.at(round_, "reported")
            return _Outcome(decision=self._await_decision(round_), tentative=tentative, new_hash=new_hash,
                            group=group_ids)
        try:
            response = self.client.report_round(request)
            if 0 < response.round.open_round < round_:
                # The coordinator is back but still behind this group (it did not count this report):
                # the group's votes decide, and the backlog brings the coordinator up to date.
                raise CoordinatorUnreachable(f"the coordinator is at round {response.round.open_round}")
        except CoordinatorUnreachable as e:
            decision = self._decide_without_coordinator(round_, key, group_ids, request, e)
            if decision is not None:
                return _Outcome(decision=decision, tentative=tentative, new_hash=new_hash, by_group=True,
                                group=group_ids)
            self._call(lambda: self.client.report_round(request), f"report round {round_}")
        faults.at(round_, "reported")
        # Should the coordinator go down before it decides, the group's votes decide instead.
        fallback = lambda error: self._decide_without_coordinator(round_, key, group_ids, request, error)  # noqa: E731
        decision = self._await_decision(round_, fallback=fallback)
        return _Outcome(decision=decision, tentative=tentative, new_hash=new_hash, group=group_ids,
                        by_group=self._decided_by_group == round_)

    def _decide_without_coordinator(self, round_: int, key: str, group_ids: list[str], request, error) -> Optional[pb.RoundInfo]:
        """The coordinator is unreachable: decide round_ from the group's DHT votes if all are in."""
        if not group_ids:
            return None
        votes = collect_votes(self.transport.dht, key, group_ids,
                              timeout_s=self.run_config.rounds.exchange_timeout_s)
        if votes is None:
            logger.warning("%s %s; not every groupmate's vote arrived, waiting for the coordinator",
                           self._tag(round_), error)
            return None
        committed = group_decision(votes)
        self._backlog.append((request, committed))
        self._decided_by_group = round_
        info = pb.RoundInfo(round=round_, open_round=round_ + 1, last_committed_round=self.trainer.round)
        if committed is None:
            info.outcome = pb.ROUND_OUTCOME_VOIDED
        else:
            info.outcome = pb.ROUND_OUTCOME_COMMITTED
            info.committed_hash = committed
            info.holders.extend(v.dht_peer_id for v in votes.values() if v.ok and v.params_hash == committed)
        logger.warning("%s coordinator unreachable; round decided by the group's %d votes: %s", self._tag(round_),
                       len(votes), f"committed {committed}" if committed else "voided")
        return info

    def _finish_round(self, pending: "_Pending") -> bool:
        """Apply a decided round; False when this peer must resync (it does not hold the committed state)."""
        outcome = pending.future.result()
        tag, decision = self._tag(pending.round), outcome.decision
        max_rounds = self.run_config.rounds.max_rounds
        holds = decision.outcome == pb.ROUND_OUTCOME_VOIDED or (
            outcome.tentative is not None and decision.committed_hash == outcome.new_hash)
        # Should the coordinator be unreachable for the next round, this group goes on without it.
        self._offline_next = pending.round + 1 if holds and (max_rounds is None or pending.round < max_rounds) else None
        if outcome.group:
            self._last_group = set(outcome.group)
        if decision.outcome == pb.ROUND_OUTCOME_VOIDED:
            logger.warning("%s voided by the %s; keeping the round %d state and this round's work for the next",
                           tag, "group" if outcome.by_group else "coordinator", self.trainer.round)
            self.trainer.return_contribution(pending.contribution)
            if not outcome.by_group:
                prune_votes(self.options.state_dir, below=self.trainer.round)
            return True
        if outcome.tentative is None or decision.committed_hash != outcome.new_hash:
            logger.info("%s committed %s, which this peer does not hold", tag, decision.committed_hash)
            return False
        params, state = outcome.tentative
        # error feedback keeps what the codec dropped from an update that was applied
        self.trainer.record_sent(pending.contribution, self.run_config.rounds.codec)
        self._commit_state(params, state, pending.round, fragment=pending.fragment, provisional=outcome.by_group)
        logger.info("%s committed, hash %s", tag, outcome.new_hash)
        self._evaluate_on_schedule(finished=decision.finished)
        return True

    def _flush_backlog(self) -> None:
        """The coordinator is back: report the rounds the group decided without it, in order, and check
        that it confirms each decision; on any contradiction this peer resyncs from its committed state."""
        backlog, self._backlog = self._backlog, []
        self._offline_next = None
        for request, local in backlog:
            self._call(lambda: self.client.report_round(request), f"report round {request.round}")
            decision = self._await_decision(request.round)
            confirmed = decision.committed_hash if decision.outcome == pb.ROUND_OUTCOME_COMMITTED else None
            if confirmed != local:
                logger.error("%s the coordinator decided %s where the group decided %s; resyncing",
                             self._tag(request.round), confirmed or "void", local or "void")
                self._force_resync()
                return
            logger.info("%s the coordinator confirmed the group's decision", self._tag(request.round))
            prune_votes(self.options.state_dir, below=min(request.round, self.trainer.round))
        self._provisional = False
        if backlog and self.trainer.round == backlog[-1][0].round and self.options.checkpoint_every_rounds > 0:
            self._checkpoint()  # the provisional rounds are confirmed: this state is safe to resume from

    def _force_resync(self) -> None:
        info = self._round_info(0)
        self._disk_tried = None  # its own vote for the committed round may be on disk
        self.trainer.round = -1  # not a committed state any more: the main loop downloads the committed one
        self.stats.update(params_round=-1)
        if info.last_committed_round >= 0:
            self._sync(info)

    def _await_decision(self, round_: int, fallback=None) -> pb.RoundInfo:
        """Wait for the coordinator's decision on round_; a peer asked to leave still waits up to
        leave_grace_s, so that it leaves holding the committed state (and checkpoints it).

        fallback(error), tried once when the coordinator stays unreachable for a few seconds, may
        return the group's decision instead.
        """
        leave_by: Optional[float] = None
        unreachable_since: Optional[float] = None
        while True:
            if self.stop.is_set():
                leave_by = leave_by or time.monotonic() + self.options.leave_grace_s
                if time.monotonic() > leave_by:
                    raise PeerExit(0)
            try:
                info = self._get_round(round_)
            except CoordinatorUnreachable as e:
                logger.warning("%s waiting for the decision: %s", self._tag(round_), e)
                info = None
                unreachable_since = unreachable_since or time.monotonic()
                if fallback is not None and time.monotonic() - unreachable_since > 2.0:
                    decision, fallback = fallback(e), None
                    if decision is not None:
                        return decision
            if info is not None and info.outcome in (pb.ROUND_OUTCOME_COMMITTED, pb.ROUND_OUTCOME_VOIDED):
                return info
            # the decision waits for the slowest groupmate's report; polled, there is no push
            time.sleep(self.options.poll_s if info is not None else 1.0)

    def _planned(self, round_: int) -> Optional[set[str]]:
        try:
            info = self._get_round(round_)
        except Exception:
            return self._last_group  # the coordinator is down: the last group, or whoever shows up
        if info.round != round_ or info.outcome != pb.ROUND_OUTCOME_OPEN:
            return self._last_group  # the coordinator has not caught up with this round (after an outage)
        self._last_group = set(info.participants)
        return self._last_group

    # ---- state ---------------------------------------------------------------------------------------
    def _commit_state(self, params, momentum, round_: int, fragment: Optional[int] = None,
                      provisional: bool = False) -> None:
        """Install a committed state. A provisional one (decided by the group while the coordinator is
        down) is neither checkpointed nor allowed to delete older votes: the coordinator may still void it."""
        self.trainer.commit(params, momentum, round_, fragment=fragment)
        self._publish_state()
        self._provisional = provisional
        if provisional:
            return
        prune_votes(self.options.state_dir, below=round_)
        every = self.options.checkpoint_every_rounds
        if round_ > 0 and every > 0 and round_ % every == 0:
            self._checkpoint()

    def _checkpoint(self) -> None:
        try:
            save_trainer(checkpoint_dir(self.options.state_dir), self.trainer, run_id=self.run_id,
                         state_hash=self.trainer.state_hash())
        except OSError as e:  # a full disk must not stop training; the next checkpoint may succeed
            logger.warning("%s could not write a checkpoint: %s", self._tag(), e)

    def _persist_vote(self, round_: int, tentative, new_hash: str) -> None:
        """Write the tentative state to disk before its hash is reported: should every peer whose vote
        counts die before hearing the decision, the committed round still survives on their disks."""
        if self.options.checkpoint_every_rounds <= 0:
            return
        try:
            save_vote(self.options.state_dir, *tentative, run_id=self.run_id, round_=round_, state_hash=new_hash)
        except OSError as e:  # the vote still counts; only this disk copy is missing
            logger.warning("%s could not write the vote to disk: %s", self._tag(round_), e)

    def _publish_state(self) -> None:
        round_ = self.trainer.round
        h = self.trainer.state_hash()
        self.state_server.publish(GlobalState(round=round_, params=list(self.trainer.global_params),
                                              momentum=list(self.trainer.momentum), hash=h))
        self.stats.update(params_hash=h, params_round=round_, state=pb.PEER_STATE_READY)
        # Tell the coordinator at once: the next round admits late peers only until its first
        # participant starts exchanging, a few inner steps away, and the heartbeat interval is longer.
        if self.heartbeat is not None:
            self.heartbeat.beat_now()

    def _sync(self, info: pb.RoundInfo) -> bool:
        """Resume the newest committed state from this peer's own disk (a checkpoint or its vote), or
        else download it from a holder; either way its hash must be the committed one."""
        target = info.last_committed_round
        if self._disk_tried != target:
            self._disk_tried = target
            if maybe_resume(self.options.state_dir, self.trainer, run_id=self.run_id, round_=target,
                            state_hash=info.last_committed_hash) is not None:
                self._offline_next = None
                self._provisional = False  # the coordinator committed this round
                self._publish_state()
                return True
        self.stats.update(state=pb.PEER_STATE_JOINING)
        self.options.faults.at(target, "syncing")
        holders_info = self._round_info(target)
        holders = list(holders_info.holders)
        logger.info("%s behind (holds round %d, committed is %d): downloading from %d holders",
                    self._tag(), self.trainer.round, target, len(holders))
        try:
            state, nbytes = download_state(
                self.transport, run_id=self.run_id, holders=holders, round_=target,
                expected_hash=info.last_committed_hash, shapes=[p.shape for p in self.trainer.global_params],
                state_shapes=self.trainer.outer.state_shapes(), timeout_s=self.options.state_timeout_s,
            )
        except StateUnavailable as e:
            logger.warning("%s %s; will retry", self._tag(), e)
            self.stop.wait(1.0)  # back off before asking the coordinator for holders again
            return False
        self.stats.add(bytes_received=nbytes)
        self._offline_next = None  # the group this peer was in moved on without it
        self._commit_state(state.params, state.momentum, target)
        logger.info("%s synced to round %d, hash %s", self._tag(), target, state.hash)
        return True

    def _evaluate_on_schedule(self, finished: bool = False) -> None:
        """Evaluate on the run's eval rounds and at its end; not after a sync (see _publish_state): the
        round was evaluated by the peers that committed it. Its status shows the last round it evaluated."""
        if finished or self.trainer.round % self.run_config.rounds.eval_every_rounds == 0:
            self._evaluate()

    def _evaluate(self) -> None:
        loss = self.trainer.eval_loss()
        self.stats.update(eval_loss=loss, eval_round=self.trainer.round)
        logger.info("%s eval loss %.4f at round %d", self._tag(), loss, self.trainer.round)

    def _finish(self) -> int:
        final_dir = self.options.state_dir / "final"
        final_dir.mkdir(parents=True, exist_ok=True)
        names = [name for name, _ in self.trainer.model.named_parameters()]
        tensors = {name: p.contiguous() for name, p in zip(names, self.trainer.global_params)}
        tmp = final_dir / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"round": str(self.trainer.round), "hash": self.trainer.state_hash()})
        os.replace(tmp, final_dir / "model.safetensors")
        logger.info("%s run finished at round %d; wrote %s", self._tag(), self.trainer.round,
                    final_dir / "model.safetensors")
        self._serve_final_state()
        return 0

    def _serve_final_state(self) -> None:
        """Stay a holder of the final state while live peers still hold an older one (a joiner, a
        restarted peer, one that missed the last round): without a holder they could not download it and
        would end without a final model. Bounded by final_serve_s and by the coordinator going away."""
        deadline = time.monotonic() + self.options.final_serve_s
        announced = False
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                info = self._get_round(0)
            except CoordinatorUnreachable:
                return  # it decides who is behind; without it, nobody can ask this peer for holders
            if info.behind_peers <= 0:
                return
            if not announced:
                logger.info("%s serving the final state to %d peers still behind", self._tag(), info.behind_peers)
                announced = True
            self.stats.update(state=pb.PEER_STATE_READY)
            self.stop.wait(self.options.poll_s)

    # ---- helpers -------------------------------------------------------------------------------------
    def _round_info(self, round_: int) -> pb.RoundInfo:
        """Round round_, retrying while the coordinator is unreachable."""
        return self._call(lambda: self._get_round(round_), "get round")

    def _get_round(self, round_: int) -> pb.RoundInfo:
        """Round round_ from the coordinator (once; raises CoordinatorUnreachable); remembers the run's
        live peer count it carries, which this peer posts with its group entries."""
        info = self.client.get_round(peer_id=self.peer_id, round=round_)
        self._live_peers = info.live_peers
        return info

    def _call(self, fn, what: str):
        result = with_retry(fn, what=f"{self._tag()} {what}", stop=self.stop)
        if result is None:
            raise PeerExit(0)
        return result

    def _tag(self, round_: Optional[int] = None) -> str:
        peer = self.peer_id or "peer"
        return f"[{peer} r{round_}]" if round_ is not None else f"[{peer}]"


@dataclass
class _Outcome:
    decision: pb.RoundInfo
    tentative: Optional[tuple]  # (params, outer state) the exchange produced, None when it failed
    new_hash: str
    by_group: bool = False  # decided from the group's DHT votes while the coordinator was unreachable
    group: list[str] = field(default_factory=list)


@dataclass
class _Pending:
    round: int
    fragment: int
    contribution: Contribution
    future: concurrent.futures.Future  # of _Outcome


def _combine(parts: list[TrainStats]) -> TrainStats:
    steps = sum(p.steps for p in parts)
    loss = sum(p.mean_loss * p.steps for p in parts if p.steps) / steps if steps else math.nan
    return TrainStats(steps=steps, samples=sum(p.samples for p in parts), tokens=sum(p.tokens for p in parts),
                      mean_loss=loss, inner_time_s=sum(p.inner_time_s for p in parts))


def run_peer(options: PeerOptions) -> int:
    """Run a peer until the run finishes; SIGINT/SIGTERM leave the run cleanly and exit 0."""
    daemon = PeerDaemon(options)
    if threading.current_thread() is threading.main_thread():
        def leave_on_signal(signum, frame):
            logger.info("%s signal %d: leaving the run after the current step", daemon._tag(), signum)
            daemon.stop.set()

        signal.signal(signal.SIGTERM, leave_on_signal)
        signal.signal(signal.SIGINT, leave_on_signal)
    return daemon.run()
