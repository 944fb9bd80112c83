"""Membership: joining, heartbeats, leases and evictions, with an injected clock (no sleeps)."""

import math

import pytest

from coordinator import membership
from coordinator.api.errors import BadToken, PeerGone, StateMismatch, UnknownPeer
from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from coordinator.store.records import EVICTED, JOINING, LEFT, READY, PeerRecord, RunRecord
from swarm.config import RoundConfig, RunConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(20)

LEASE_S = 10.0


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_engine(clock: FakeClock, **rounds: object) -> CoordinatorEngine:
    config = RunConfig(rounds=RoundConfig(**rounds))
    return CoordinatorEngine(Store(":memory:"), config=config, lease_s=LEASE_S, clock=clock)


def run_record(**fields: object) -> RunRecord:
    values = dict(model_fingerprint="fp", initial_hash="h0", param_count=100)  # what the config would give
    values.update(fields)
    return RunRecord(run_id="run-x", token="secret", run_spec_json="{}", created_at=0.0, **values)


def ready_beat(peer_id: str, engine: CoordinatorEngine | None = None, **fields: object) -> pb.HeartbeatRequest:
    """A ready peer's heartbeat holding θ0: the model and hash of ``engine``'s run (else "fp" and "h0")."""
    values = dict(state=READY, state_round=0, state_hash="h0", model_fingerprint="fp", param_count=100)
    if engine is not None:
        values.update(state_hash=engine.run.initial_hash, model_fingerprint=engine.run.model_fingerprint)
    values.update(fields)
    return pb.HeartbeatRequest(peer_id=peer_id, metrics=pb.PeerMetrics(**values))


# --- pure functions -----------------------------------------------------------------------------


def test_new_peers_get_increasing_indices_and_a_lease() -> None:
    run = run_record()
    run, first = membership.new_peer(run, peer_id="p-1", now=5.0, lease_s=LEASE_S, name="a")
    run, second = membership.new_peer(run, peer_id="p-2", now=6.0, lease_s=LEASE_S)
    assert (first.peer_index, second.peer_index, run.next_peer_index) == (0, 1, 2)
    assert first.state == JOINING and first.lease_expiry == 15.0


def test_lease_expiry_evicts_only_after_the_lease() -> None:
    peer = PeerRecord(peer_id="p-1", peer_index=0, joined_at=0.0, last_seen=0.0, lease_expiry=LEASE_S)
    assert membership.expired([peer], now=LEASE_S) == []
    (evicted,) = membership.expired([peer], now=LEASE_S + 0.5)
    assert evicted.state == EVICTED and evicted.gone_reason == "no heartbeat for 10s"
    assert membership.expired([evicted], now=100.0) == []  # evicted once


def test_a_lease_sweep_evicts_nobody_while_saturated_and_then_renews_every_live_lease() -> None:
    peer = PeerRecord(peer_id="p-1", peer_index=0, joined_at=0.0, last_seen=0.0, lease_expiry=LEASE_S)
    sweep = membership.LeaseSweep()
    assert sweep.sweep(20.0, overloaded=True, peers=[peer], expired=[], lease_s=LEASE_S) == []
    assert sweep.sweep(21.0, overloaded=True, peers=[peer], expired=[], lease_s=LEASE_S) == []
    assert sweep.pauses == 1  # one pause, however many sweeps it lasts
    (renewed,) = sweep.sweep(30.0, overloaded=False, peers=[peer], expired=[peer], lease_s=LEASE_S)
    assert renewed.alive and renewed.lease_expiry == 30.0 + LEASE_S
    (evicted,) = sweep.sweep(50.0, overloaded=False, peers=[renewed], expired=[renewed], lease_s=LEASE_S)
    assert evicted.state == EVICTED and evicted.gone_reason == "no heartbeat for 50s"


def test_heartbeat_records_stats_and_leaves_the_run_model_alone() -> None:
    run = run_record()
    peer = PeerRecord(peer_id="p-1", peer_index=0, joined_at=0.0, last_seen=0.0, lease_expiry=LEASE_S)
    hb = ready_beat(
        "p-1", loss=2.5, tokens=1000, inner_time_s=3.0, wall_time_s=4.0, dht_peer_id="Qm1", eval_loss=3.0, eval_round=0
    )
    result = membership.apply_heartbeat(run, peer, hb, now=5.0, lease_s=LEASE_S)
    assert result.rejection is None
    assert (result.run.model_fingerprint, result.run.initial_hash) == ("fp", "h0")
    assert result.run.initial_eval_loss == 3.0 and result.run.eval_round == 0
    assert result.peer.state == READY and result.peer.lease_expiry == 15.0
    assert result.peer.metrics == hb.metrics  # kept whole


def test_a_heartbeat_without_the_peer_identity_keeps_the_known_one() -> None:
    run = run_record()
    peer = PeerRecord(peer_id="p-1", peer_index=0, joined_at=0.0, last_seen=0.0, lease_expiry=LEASE_S)
    first = membership.apply_heartbeat(
        run, peer, ready_beat("p-1", dht_peer_id="Qm1", dht_maddrs=["/ip4/x"]), now=1.0, lease_s=LEASE_S
    )
    bare = pb.HeartbeatRequest(peer_id="p-1", metrics=pb.PeerMetrics(state=READY, loss=1.5))
    later = membership.apply_heartbeat(first.run, first.peer, bare, now=2.0, lease_s=LEASE_S).peer.metrics
    assert (later.model_fingerprint, later.param_count, later.dht_peer_id, list(later.dht_maddrs)) == (
        "fp",
        100,
        "Qm1",
        ["/ip4/x"],
    )
    assert (later.loss, later.state_hash) == (1.5, "")  # the measurements are the new ones


def test_a_restarted_peers_measured_step_time_outlasts_its_start_up_probe() -> None:
    """Its last session's rounds measured it; the new process's probe is an estimate: the coordinator budgets the
    restarted peer by the measurement until its first round measures it again."""
    run = run_record()
    peer = PeerRecord(peer_id="p-1", peer_index=0, joined_at=0.0, last_seen=0.0, lease_expiry=LEASE_S)

    def beat(peer, now: float, **metrics) -> PeerRecord:
        request = pb.HeartbeatRequest(peer_id="p-1", metrics=pb.PeerMetrics(state=READY, **metrics))
        return membership.apply_heartbeat(run, peer, request, now=now, lease_s=LEASE_S).peer

    probed = beat(peer, 1.0, step_time_s=0.9, step_time_probed=True)
    assert (probed.metrics.step_time_s, probed.metrics.step_time_probed) == (0.9, True)  # nothing measured yet
    measured = beat(probed, 2.0, step_time_s=0.3)
    restarted = beat(
        beat(measured, 3.0, step_time_s=0.8, step_time_probed=True), 4.0, step_time_s=0.7, step_time_probed=True
    )
    assert (restarted.metrics.step_time_s, restarted.metrics.step_time_probed) == (0.3, False)
    assert beat(restarted, 5.0, step_time_s=0.35).metrics.step_time_s == 0.35  # its new rounds' measurement


def test_newest_eval_wins_and_missing_eval_is_ignored() -> None:
    run = membership.record_eval(run_record(), 3.0, 2)
    run = membership.record_eval(run, 4.0, 1)  # older round: ignored
    run = membership.record_eval(run, 0.0, 5)  # no evaluation in this heartbeat
    run = membership.record_eval(run, math.nan, 6)
    assert (run.eval_loss, run.eval_round) == (3.0, 2)
    assert math.isnan(run.initial_eval_loss)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("model_fingerprint", "other-fp", "this peer's model (fingerprint other-fp) does not match the run's (fp)"),
        ("state_hash", "h-other", "initial model state (hash h-other) differs from the run's (h0)"),
    ],
)
def test_model_or_initial_state_mismatch_evicts(field: str, value: str, words: str) -> None:
    run = run_record(model_fingerprint="fp", initial_hash="h0")
    peer = PeerRecord(peer_id="p-1", peer_index=0, joined_at=0.0, last_seen=0.0, lease_expiry=LEASE_S)
    result = membership.apply_heartbeat(run, peer, ready_beat("p-1", **{field: value}), now=1.0, lease_s=LEASE_S)
    assert result.peer.state == EVICTED
    assert isinstance(result.rejection, StateMismatch) and result.rejection.code == "FAILED_PRECONDITION"
    assert words in str(result.rejection)
    assert (
        "use the run's [model] code (the same factory module, preset or hf_config) and the coordinator's Swarm "
        "release, then start the peer again." in str(result.rejection)
    )


def test_ready_means_alive_holding_the_last_committed_state() -> None:
    base = PeerRecord(
        peer_id="p",
        peer_index=0,
        joined_at=0,
        last_seen=0,
        lease_expiry=9,
        state=READY,
        metrics=pb.PeerMetrics(state_round=3, state_hash="h3"),
    )
    assert membership.is_ready(base, 3, "h3")
    assert not membership.is_ready(base, 4, "h4")  # behind
    assert not membership.is_ready(base, 3, "other")  # diverged
    assert not membership.is_ready(PeerRecord(**{**base.__dict__, "state": JOINING}), 3, "h3")
    assert not membership.is_ready(PeerRecord(**{**base.__dict__, "state": LEFT}), 3, "h3")


# --- through the engine, with a fake clock --------------------------------------------------------


def test_join_then_heartbeat_then_eviction_after_the_lease() -> None:
    clock = FakeClock()
    engine = make_engine(clock)
    peer, info = engine_join(engine, name="a", site="lab")
    assert peer.peer_id.startswith("p-") and len(peer.peer_id) == 18  # derived from its key
    assert info.round == 0 and info.open_round == 0
    clock.now += LEASE_S - 1
    engine.heartbeat(ready_beat(peer.peer_id, engine))  # renews the lease
    clock.now += LEASE_S - 1
    engine.tick()
    assert engine.status(engine.run.token).peers[0].state == "ready"
    clock.now += 2
    engine.tick()
    assert engine.status(engine.run.token).peers[0].state == "evicted"
    with pytest.raises(PeerGone, match=r"was evicted \(no heartbeat for 11s\); restart the peer to join again"):
        engine.heartbeat(ready_beat(peer.peer_id, engine))


def test_late_heartbeat_is_evicted_before_it_is_applied() -> None:
    clock = FakeClock()
    engine = make_engine(clock)
    peer, _ = engine_join(engine)
    clock.now += LEASE_S + 1  # no tick in between: the RPC itself notices the expired lease
    with pytest.raises(PeerGone, match="was evicted"):
        engine.heartbeat(ready_beat(peer.peer_id, engine))


def test_bad_token_and_unknown_peer_are_refused() -> None:
    engine = make_engine(FakeClock())
    with pytest.raises(BadToken):
        engine_join(engine, "wrong")
    with pytest.raises(BadToken):
        engine.status("wrong")
    with pytest.raises(UnknownPeer, match=r"peer p-nobody is not a member of this run; restart `swarm peer --join"):
        engine.heartbeat(ready_beat("p-nobody", engine))
    assert UnknownPeer.code == "NOT_FOUND"


def test_left_peer_is_told_to_rejoin_and_its_index_is_not_reused() -> None:
    engine = make_engine(FakeClock())
    first, _ = engine_join(engine)
    engine.leave(first.peer_id, "shutting down")
    engine.leave(first.peer_id)  # twice is fine
    with pytest.raises(PeerGone, match=r"left the run \(shutting down\); restart the peer to join again"):
        engine.heartbeat(ready_beat(first.peer_id, engine))
    second, _ = engine_join(engine)
    assert second.peer_index == 1


def test_fingerprint_mismatch_eviction_is_saved_although_the_call_fails() -> None:
    engine = make_engine(FakeClock())
    good, _ = engine_join(engine)
    bad, _ = engine_join(engine)
    engine.heartbeat(ready_beat(good.peer_id, engine))
    with pytest.raises(StateMismatch, match="does not match the run's"):
        engine.heartbeat(ready_beat(bad.peer_id, engine, model_fingerprint="another-model"))
    states = {p.id: p.state for p in engine.status(engine.run.token).peers}
    assert states == {good.peer_id: "ready", bad.peer_id: "evicted"}
    with pytest.raises(PeerGone, match="model fingerprint"):
        engine.heartbeat(ready_beat(bad.peer_id, engine))


def test_a_restarted_coordinator_counts_the_fresh_leases_from_when_it_serves_with_a_grace(tmp_path) -> None:
    # chaos soak: a 4 s lease counted from the store's load ran out while the DHT node started; every peer was
    # evicted the second the coordinator listened, before any could heartbeat
    clock = FakeClock()
    config = RunConfig()
    store = Store(tmp_path / "c.sqlite3")
    engine = CoordinatorEngine(store, config=config, lease_s=LEASE_S, clock=clock)
    back, _ = engine_join(engine)
    gone, _ = engine_join(engine)
    store.close()
    clock.now += 10 * LEASE_S  # down
    engine = CoordinatorEngine(Store(tmp_path / "c.sqlite3"), config=config, lease_s=LEASE_S, clock=clock)
    clock.now += 2 * LEASE_S  # the DHT node, TLS: longer than a lease
    engine.serving()
    clock.now += LEASE_S + membership.RESTART_GRACE_S - 1  # the peer's channel reconnected late in the grace
    engine.tick()
    engine.heartbeat(ready_beat(back.peer_id, engine))  # still a member
    clock.now += 2
    engine.tick()
    states = {p.id: p.state for p in engine.status(engine.run.token).peers}
    assert states == {back.peer_id: "ready", gone.peer_id: "evicted"}


def test_restart_gives_alive_peers_a_fresh_lease(tmp_path) -> None:
    clock = FakeClock()
    config = RunConfig()
    store = Store(tmp_path / "c.sqlite3")
    engine = CoordinatorEngine(store, config=config, lease_s=LEASE_S, clock=clock)
    peer, _ = engine_join(engine)
    store.close()
    clock.now += 10 * LEASE_S  # the coordinator was down much longer than a lease
    engine = CoordinatorEngine(Store(tmp_path / "c.sqlite3"), config=config, lease_s=LEASE_S, clock=clock)
    engine.heartbeat(ready_beat(peer.peer_id, engine))  # still a member
