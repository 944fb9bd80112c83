"""Membership decisions: who joined, who is alive, who is ready, who is evicted and why.

Pure functions over records with an explicit ``now``; they return new records (and, for a
heartbeat, the rejection to send) and never touch the store or the clock. ``LeaseSweep`` remembers one fact
besides: whether evictions for missed leases are paused while the server is saturated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from coordinator.api.errors import PeerGone, Rejection, StateMismatch, UnknownPeer
from coordinator.api.limits import MAX_DHT_MADDRS
from coordinator.store.records import (
    EVICTED,
    GONE_STATES,
    HOLDING_STATES,
    JOINING,
    LEFT,
    PeerRecord,
    RunRecord,
    finite,
)
from swarm.v1 import coordinator_pb2 as pb

_REPORTABLE_STATES = (JOINING,) + HOLDING_STATES  # what a heartbeat may set; leaving goes through Leave
# the eviction reasons of a peer whose model or θ0 is not the run's (how they start)
_OTHER_MODEL = "it builds a different model than the run"
_OTHER_THETA0 = "it draws other initial weights than the run"
# what a peer evicted for another model or θ0 must do: restarting it as it is would build the same model again
logger = logging.getLogger(__name__)
MISMATCH_REMEDY = (
    "use the run's [model] code (the same factory module, preset or hf_config) and the coordinator's "
    "Swarm release, then start the peer again"
)


def new_peer(
    run: RunRecord,
    *,
    peer_id: str,
    now: float,
    lease_s: float,
    name: str = "",
    site: str = "",
    device: str = "",
    swarm_version: str = "",
    public_key: bytes = b"",
    dht_peer_id: str = "",
    token_id: str = "",
    previous: Optional[PeerRecord] = None,
) -> tuple[RunRecord, PeerRecord]:
    """A new member in state JOINING with the next unused peer index, or with the index of ``previous``
    (the record this key had before its peer restarted: same index, same data shard) and its next session."""
    index = previous.peer_index if previous is not None else run.next_peer_index
    peer = PeerRecord(
        peer_id=peer_id,
        peer_index=index,
        joined_at=now,
        last_seen=now,
        lease_expiry=now + lease_s,
        state=JOINING,
        name=name,
        site=site,
        device=device,
        swarm_version=swarm_version,
        public_key=bytes(public_key).hex(),
        dht_peer_id=dht_peer_id,
        token_id=token_id,
        session=previous.session + 1 if previous is not None else 1,
        rounds_joined=previous.rounds_joined if previous is not None else 0,
        rounds_missed=previous.rounds_missed if previous is not None else 0,
    )
    if previous is not None:
        return run, peer
    return dataclasses.replace(run, next_peer_index=run.next_peer_index + 1), peer


def check_member(peer_id: str, peer: Optional[PeerRecord]) -> PeerRecord:
    """The peer's record if it is a live member; otherwise the rejection that tells it to rejoin."""
    if peer is None:
        raise UnknownPeer(peer_id)
    if peer.state == EVICTED:
        remedy = (
            "ask the operator for a new join string"
            if "revoked" in peer.gone_reason
            else MISMATCH_REMEDY
            if peer.gone_reason.startswith((_OTHER_MODEL, _OTHER_THETA0))
            else "restart the peer to join again"
        )
        raise PeerGone(f"peer {peer_id} was evicted ({peer.gone_reason}); {remedy}.")
    if peer.state == LEFT:
        raise PeerGone(f"peer {peer_id} left the run ({peer.gone_reason}); restart the peer to join again.")
    return peer


def check_session(peer: PeerRecord, session: int) -> None:
    """A call of an older session than the peer's latest join comes from a process that was replaced."""
    if session < peer.session:
        raise PeerGone(
            f"peer {peer.peer_id} was replaced: another process joined with its state dir "
            f"(session {peer.session}, this process has session {session}); "
            "give every peer its own --state-dir."
        )


def expired(peers: Iterable[PeerRecord], now: float) -> list[PeerRecord]:
    """Evicted copies of the live peers whose lease ran out before ``now``."""
    return [
        evict(p, f"no heartbeat for {now - p.last_seen:.0f}s")
        for p in peers
        if p.state not in GONE_STATES and now > p.lease_expiry
    ]


def evict(peer: PeerRecord, reason: str) -> PeerRecord:
    return dataclasses.replace(peer, state=EVICTED, gone_reason=reason)


def leave(peer: PeerRecord, reason: str) -> PeerRecord:
    return dataclasses.replace(peer, state=LEFT, gone_reason=reason or "it said goodbye")


def counted_rounds(
    peers: Mapping[str, PeerRecord], *, joined: Iterable[str], missed: Iterable[str]
) -> list[PeerRecord]:
    """The decided round's participants with it counted: joined (they hold its state) or missed. Only the two
    counters differ from the records in ``peers``, copied field by field (a round of thousands is counted at once)."""
    counted = [_with_count(peers[p], "rounds_joined") for p in joined if p in peers]
    return counted + [_with_count(peers[p], "rounds_missed") for p in missed if p in peers]


def _with_count(peer: PeerRecord, name: str) -> PeerRecord:
    """``dataclasses.replace(peer, name=+1)`` without its per-field checks: a frozen record's fields copied as
    they are, one counter added to."""
    counted = object.__new__(PeerRecord)
    fields = counted.__dict__
    fields.update(peer.__dict__)
    fields[name] += 1
    return counted


# After a coordinator restart every live peer gets a lease plus this long to check in: the peers could not heartbeat
# while it was down or starting, and their gRPC channels reconnect with a backoff. Counted from the store's load
# with no grace, a 4 s lease evicted every peer of a chaos soak the moment the restarted coordinator listened.
RESTART_GRACE_S = 10.0


def restart_leases(peers: Iterable[PeerRecord], *, now: float, lease_s: float) -> list[PeerRecord]:
    """The live peers with their lease extended to a lease plus ``RESTART_GRACE_S`` from ``now``."""
    return renewed_leases(peers, until=now + lease_s + RESTART_GRACE_S)


def renewed_leases(peers: Iterable[PeerRecord], *, until: float) -> list[PeerRecord]:
    """The live peers whose lease ends before ``until``, with it extended to ``until``."""
    return [dataclasses.replace(p, lease_expiry=until) for p in peers if p.alive and p.lease_expiry < until]


class LeaseSweep:
    """Which peers a sweep evicts for a missed lease, unless the server is saturated: their heartbeats may be among
    the calls it queued or refused. Once it is not, every live peer has a full lease from then on."""

    def __init__(self) -> None:
        self.paused_since: Optional[float] = None  # evictions paused: the server is saturated
        self.pauses = 0  # how often, since the start

    def sweep(
        self,
        now: float,
        *,
        overloaded: bool,
        peers: Iterable[PeerRecord],
        expired: Iterable[PeerRecord],
        lease_s: float,
    ) -> list[PeerRecord]:
        """The records to save: the ``expired`` peers evicted, or the live ``peers`` renewed as a pause ends
        (``expired`` is iterated only when nothing is paused)."""
        if overloaded:
            if self.paused_since is None:
                self.paused_since = now
                self.pauses += 1
                logger.warning("coordinator saturated: no peer is evicted for a missed lease until it is not")
            return []
        changed: list[PeerRecord] = []
        if self.paused_since is not None:
            changed = renewed_leases(peers, until=now + lease_s)
            logger.warning(
                "coordinator no longer saturated after %.0fs: every live peer's lease runs %.0fs from now",
                now - self.paused_since,
                lease_s,
            )
            self.paused_since = None
            return changed
        for peer in expired:
            changed.append(evict(peer, f"no heartbeat for {now - peer.last_seen:.0f}s"))
            logger.warning("peer %s: evicted: %s", peer.peer_id, changed[-1].gone_reason)
        return changed


def with_links(peer: PeerRecord, report: pb.ReportRoundRequest) -> PeerRecord:
    """``peer`` with the link estimates its round report carries (the ones it measured are finite and > 0):
    the controller plans the next round from them, not from a heartbeat that may come after the decision."""
    measured = {
        name: getattr(report, name)
        for name in ("upload_mbit_s", "download_mbit_s", "rtt_ms")
        if math.isfinite(getattr(report, name)) and getattr(report, name) > 0
    }
    if not measured:
        return peer
    metrics = pb.PeerMetrics()
    metrics.CopyFrom(peer.metrics)
    for name, value in measured.items():
        setattr(metrics, name, value)
    return dataclasses.replace(peer, metrics=metrics)


def touch(peer: PeerRecord, now: float, lease_s: float) -> PeerRecord:
    """Any message from a peer shows it is alive: extend its lease."""
    return dataclasses.replace(peer, last_seen=now, lease_expiry=now + lease_s)


@dataclass(frozen=True)
class HeartbeatResult:
    run: RunRecord
    peer: PeerRecord
    rejection: Optional[Rejection] = None  # to send after saving; the peer was evicted


def apply_heartbeat(
    run: RunRecord, peer: PeerRecord, hb: pb.HeartbeatRequest, *, now: float, lease_s: float
) -> HeartbeatResult:
    """Record a live peer's heartbeat; evict it when its model or initial state differs from the run's (which
    the coordinator derived from the config: see coordinator.store.run_identity)."""
    peer = touch(peer, now, lease_s)
    reported = hb.metrics
    if reported.model_fingerprint and reported.model_fingerprint != run.model_fingerprint:
        return _mismatch(
            run,
            peer,
            reason=(
                f"{_OTHER_MODEL}: model fingerprint {_short(reported.model_fingerprint)}, the run's "
                f"{_short(run.model_fingerprint)}"
            ),
            sentence=(
                f"this peer's model (fingerprint {_short(reported.model_fingerprint)}) does not match the run's "
                f"({_short(run.model_fingerprint)}): this peer {_OTHER_MODEL[3:]}; {MISMATCH_REMEDY}."
            ),
        )
    if reported.state_round == 0 and reported.state_hash and reported.state_hash != run.initial_hash:
        return _mismatch(
            run,
            peer,
            reason=f"{_OTHER_THETA0}: initial state {_short(reported.state_hash)}, the run's {_short(run.initial_hash)}",
            sentence=(
                f"this peer's initial model state (hash {_short(reported.state_hash)}) differs from the run's "
                f"({_short(run.initial_hash)}): this peer {_OTHER_THETA0[3:]}; {MISMATCH_REMEDY}."
            ),
        )
    state = reported.state if reported.state in _REPORTABLE_STATES else peer.state
    metrics = _merge_metrics(peer.metrics, reported)
    if peer.dht_peer_id:  # proven at join: the holder id others download from is never the heartbeat's word
        metrics.dht_peer_id = peer.dht_peer_id
    peer = dataclasses.replace(peer, state=state, metrics=metrics)
    return HeartbeatResult(run=record_eval(run, reported.eval_loss, reported.eval_round), peer=peer)


# A peer's identity: a heartbeat that leaves one of these empty does not erase what an earlier one said.
_IDENTITY_METRICS = ("model_fingerprint", "param_count", "dht_peer_id", "dht_maddrs")


def _merge_metrics(previous: pb.PeerMetrics, reported: pb.PeerMetrics) -> pb.PeerMetrics:
    """The reported metrics, with the identity fields it left empty taken from ``previous``; and a step time measured
    by the peer's rounds kept over its start-up probe's estimate (a restarted peer: its last session measured it)."""
    merged = pb.PeerMetrics()
    merged.CopyFrom(reported)
    for name in _IDENTITY_METRICS:
        if not getattr(reported, name):
            merged.MergeFrom(pb.PeerMetrics(**{name: getattr(previous, name)}))
    if reported.step_time_probed and previous.step_time_s > 0 and not previous.step_time_probed:
        merged.step_time_s, merged.step_time_probed = previous.step_time_s, False
    del merged.dht_maddrs[MAX_DHT_MADDRS:]  # a restarted coordinator dials these: keep it bounded
    return merged


def record_eval(run: RunRecord, eval_loss: float, eval_round: int) -> RunRecord:
    """Keep the newest evaluation (by round) and the one of the initial state (round 0).

    A heartbeat carries an evaluation when its eval_loss is a positive finite number; eval_round 0
    then means the initial state.
    """
    if not (finite(eval_loss) and eval_loss > 0 and eval_round >= 0):
        return run
    if eval_round == 0 and not finite(run.initial_eval_loss):
        run = dataclasses.replace(run, initial_eval_loss=eval_loss)
    if eval_round >= run.eval_round:
        run = dataclasses.replace(run, eval_loss=eval_loss, eval_round=eval_round)
    return run


def is_ready(peer: PeerRecord, last_committed_round: int, last_committed_hash: str) -> bool:
    """Alive, says it is ready (or busy in a round) and holds exactly the last committed state."""
    return (
        peer.alive
        and peer.state in HOLDING_STATES
        and bool(last_committed_hash)
        and peer.metrics.state_round == last_committed_round
        and peer.metrics.state_hash == last_committed_hash
    )


def ready_peer_ids(peers: Iterable[PeerRecord], last_committed_round: int, last_committed_hash: str) -> list[str]:
    """Ids of the ready peers, in joining order."""
    ready = [p for p in peers if is_ready(p, last_committed_round, last_committed_hash)]
    return [p.peer_id for p in sorted(ready, key=lambda p: p.peer_index)]


def _mismatch(run: RunRecord, peer: PeerRecord, *, reason: str, sentence: str) -> HeartbeatResult:
    return HeartbeatResult(run=run, peer=evict(peer, reason), rejection=StateMismatch(sentence))


def _short(digest: str) -> str:
    return digest if len(digest) <= 16 else digest[:16] + "…"
