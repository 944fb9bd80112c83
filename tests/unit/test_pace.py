"""The coordinator paces its peers: a heartbeat interval and a lease that stretch with the swarm so its load
stays within its budget, a slow-down before it refuses anyone, no eviction for a lease that ran out while it
was saturated, and RoundInfo answers whose size does not grow with the number of holders."""

import threading

import pytest

from coordinator.api.load import MAX_IN_FLIGHT, REFUSE_WAIT_S, SLOW_DOWN_AT, LoadMonitor
from coordinator.api.views import HOLDERS_SENT, holder_sample
from coordinator.engine import CoordinatorEngine
from coordinator.pace import HEARTBEATS_PER_S, POLLS_PER_S, PaceConfig, Pacer, pace_for
from coordinator.store.database import Store
from peer.link.heartbeat import HeartbeatThread
from swarm.config import RoundConfig, RunConfig
from swarm.control.client import CoordinatorBusy
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(60)


def beat(engine: CoordinatorEngine, peer_id: str, **metrics) -> pb.RoundInfo:
    return engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=peer_id,
            metrics=pb.PeerMetrics(
                state=pb.PEER_STATE_JOINING, state_round=-1, dht_peer_id="dht-" + peer_id, **metrics
            ),
        )
    )


def test_a_small_swarm_keeps_the_operators_interval_and_a_large_one_stays_within_the_budget() -> None:
    config = PaceConfig(heartbeat_interval_s=2.0, lease_s=15.0)
    most = int(HEARTBEATS_PER_S * 2.0)  # the most peers that heartbeat every 2 s within the budget
    for peers in (0, 5, most):
        assert (pace_for(config, peers).heartbeat_interval_s, pace_for(config, peers).lease_s) == (2.0, 15.0)
    assert pace_for(config, int(POLLS_PER_S * 0.2)).poll_interval_s <= 0.2  # a peer's own poll interval: no change
    for peers in (most + 1, 2_000, 10_000, 100_000):
        pace = pace_for(config, peers)
        assert peers / pace.heartbeat_interval_s <= HEARTBEATS_PER_S * 1.001
        assert pace.lease_s / pace.heartbeat_interval_s == pytest.approx(15.0 / 2.0, rel=1e-3)  # beats per lease
    slowed = pace_for(config, 10_000, slowdown=4.0)
    assert slowed.heartbeat_interval_s == pytest.approx(4 * pace_for(config, 10_000).heartbeat_interval_s, rel=1e-3)
    assert slowed.lease_s == pytest.approx(4 * pace_for(config, 10_000).lease_s, rel=1e-3)
    assert pace_for(config, 10_000).poll_interval_s == pytest.approx(10_000 / POLLS_PER_S, rel=1e-3)


def test_the_pace_is_logged_when_its_interval_changes_by_a_quarter(caplog: pytest.LogCaptureFixture) -> None:
    pacer = Pacer(PaceConfig(heartbeat_interval_s=2.0, lease_s=15.0))
    k = HEARTBEATS_PER_S / 300  # the swarm sizes below are a budget of 300 a second's
    with caplog.at_level("INFO", logger="coordinator.pace"):
        for live in (10, 600, 700, 900, 1000):  # intervals 2, 2, 2.33 (+17%), 3 (+50%), 3.33 (+11% of 3)
            pacer.pace(round(live * k))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"pace for {round(900 * k)} live peers"]
    assert pacer.last == pace_for(PaceConfig(heartbeat_interval_s=2.0, lease_s=15.0), round(1000 * k))


def test_the_engine_stretches_the_lease_of_a_large_swarm_so_slower_heartbeats_do_not_evict() -> None:
    now = [1_000.0]
    engine = CoordinatorEngine(
        Store(":memory:"),
        config=RunConfig(rounds=RoundConfig(min_peers=100_000)),
        clock=lambda: now[0],
        heartbeat_interval_s=1.0,
        lease_s=5.0,
    )
    n = int(HEARTBEATS_PER_S)  # the most peers that heartbeat every second within the budget
    peers = [engine_join(engine)[0].peer_id for _ in range(n)]
    assert (engine.pace().heartbeat_interval_s, engine.lease_s) == (1.0, 5.0)  # as configured
    peers += [engine_join(engine)[0].peer_id for _ in range(n)]
    pace = engine.pace()
    assert pace.heartbeat_interval_s == pytest.approx(2.0) and pace.lease_s == pytest.approx(10.0)
    for p in peers:
        info = beat(engine, p)
    assert info.poll_interval_s == pytest.approx(2 * n / POLLS_PER_S)  # the waiting peers' polls within the budget
    now[0] += 8.0  # longer than the configured lease, within the stretched one
    assert beat(engine, peers[0]).live_peers == 2 * n


class FakeLoad:
    def __init__(self) -> None:
        self.saturated, self.factor = False, 1.0

    def overloaded(self) -> bool:
        return self.saturated

    def slowdown(self) -> float:
        return self.factor


def test_no_peer_is_evicted_for_a_lease_that_ran_out_while_the_coordinator_was_saturated() -> None:
    now, load = [1_000.0], FakeLoad()
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig(), clock=lambda: now[0], lease_s=10.0, load=load)  # type: ignore[arg-type]
    quiet, talker = engine_join(engine)[0].peer_id, engine_join(engine)[0].peer_id
    load.saturated, load.factor = True, 2.0
    assert engine.pace().heartbeat_interval_s == 4.0  # told to slow down first
    now[0] += 60.0  # its heartbeats were queued or refused all along
    engine.tick()
    assert beat(engine, talker).live_peers == 2
    load.saturated, load.factor = False, 1.0
    now[0] += 1.0
    engine.tick()  # the leases run from the end of the saturation
    assert beat(engine, talker).live_peers == 2
    assert engine.eviction_pauses == 1
    now[0] += 6.0
    beat(engine, talker)
    now[0] += 6.0  # a lease after the saturation: the silent peer is gone, the one that called is not
    engine.tick()
    states = {p.id: p.state for p in engine.status(engine.run.token).peers}
    assert states == {quiet: "evicted", talker: "joining"}


def test_the_load_monitor_slows_peers_down_before_it_sheds_calls_and_sheds_what_can_wait_first() -> None:
    now = [0.0]
    monitor = LoadMonitor(clock=lambda: now[0])
    assert monitor.admit("Heartbeat", 0) and monitor.slowdown() == 1.0
    assert monitor.admit("Heartbeat", SLOW_DOWN_AT)  # queueing: accepted, and peers are asked to slow down
    assert monitor.slowdown() == 2.0 and not monitor.overloaded()
    half, most = MAX_IN_FLIGHT // 2, MAX_IN_FLIGHT * 3 // 4
    assert not monitor.admit("Join", half) and monitor.admit("Heartbeat", half)
    assert not monitor.admit("Heartbeat", most) and monitor.admit("ReportRound", most)
    assert not monitor.admit("ReportRound", MAX_IN_FLIGHT)
    assert monitor.overloaded() and monitor.snapshot()["refused"] == {"Join": 1, "Heartbeat": 1, "ReportRound": 1}
    now[0] += 1.0
    monitor.waited(0.5)  # still queueing a second later: slower again
    assert monitor.slowdown() == 4.0
    now[0] += 30.0  # calm: the factor comes back down, one halving per step
    assert monitor.slowdown() == 2.0 and not monitor.overloaded()
    now[0] += 30.0
    assert monitor.slowdown() == 1.0


def test_calls_that_wait_long_for_the_loop_are_shed_by_priority_and_admitted_again_once_it_catches_up() -> None:
    now = [0.0]
    monitor = LoadMonitor(clock=lambda: now[0])
    monitor.waited(REFUSE_WAIT_S * 0.6)  # the loop was stalled: what can wait is refused, a round's calls are not
    assert not monitor.admit("Join", 0) and monitor.admit("Heartbeat", 0) and monitor.admit("ReportRound", 0)
    assert monitor.overloaded() and monitor.slowdown() == 2.0
    monitor.waited(REFUSE_WAIT_S)
    assert not monitor.admit("Heartbeat", 0) and not monitor.admit("ReportRound", 0)
    monitor.waited(0.001)  # caught up
    assert monitor.admit("Join", 0) and monitor.admit("ReportRound", 0)
    monitor.waited(REFUSE_WAIT_S)
    now[0] += 2.0  # a wait measured long ago refuses nothing
    assert monitor.admit("Join", 0)


def test_a_round_info_names_a_bounded_sample_of_holders_stable_per_requester_and_spread_over_all() -> None:
    holders = [f"dht-{i}" for i in range(500)]
    sample = holder_sample(holders, "p-a", round_no=3)
    assert len(sample) == HOLDERS_SENT and set(sample) <= set(holders)
    assert holder_sample(holders, "p-a", round_no=3) == sample
    seen = set()
    for i in range(200):
        seen.update(holder_sample(holders, f"p-{i}", round_no=3))
    assert len(seen) > 400  # downloads spread over (nearly) every holder
    assert holder_sample(holders[:5], "p-a", round_no=3) == holders[:5]


def test_the_engine_answers_with_at_most_sixteen_holders_however_many_hold_the_state() -> None:
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig(rounds=RoundConfig(min_peers=100_000)))
    peers = [engine_join(engine)[0].peer_id for _ in range(40)]
    initial = engine.run.initial_hash
    for p in peers:
        info = engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=p,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY, state_round=0, state_hash=initial, dht_peer_id="dht-" + p
                ),
            )
        )
    assert len(info.holders) == HOLDERS_SENT and info.live_peers == 40
    assert len(engine.round_info(peers[0], 0).holders) == HOLDERS_SENT


class PacedClient:
    """Answers heartbeats with the interval the test sets; raises CoordinatorBusy while ``busy``."""

    def __init__(self) -> None:
        self.interval_s, self.busy, self.calls = 0.0, False, threading.Semaphore(0)

    def heartbeat(self, request):
        self.calls.release()
        if self.busy:
            raise CoordinatorBusy("the coordinator is saturated")
        return pb.HeartbeatResponse(heartbeat_interval_s=self.interval_s)


class Stats:
    def metrics(self) -> pb.PeerMetrics:
        return pb.PeerMetrics()

    def heartbeat_request(self, peer_id: str) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(peer_id=peer_id)


def test_a_peer_heartbeats_at_the_coordinators_pace_and_backs_off_when_told_it_is_busy() -> None:
    client, stop = PacedClient(), threading.Event()
    thread = HeartbeatThread(client, "p-1", Stats(), stop, interval_s=0.2)  # type: ignore[arg-type]
    thread.start()
    try:
        assert client.calls.acquire(timeout=5)
        assert thread.interval_s == 0.2  # a coordinator that sends no pace: the join's interval stands
        client.interval_s = 7.5
        thread.beat_now()
        assert client.calls.acquire(timeout=5)
        thread.beat_now()
        assert client.calls.acquire(timeout=5)
        assert thread.interval_s == 7.5
        client.busy = True
        thread.beat_now()
        assert client.calls.acquire(timeout=5)
        thread.beat_now()
        assert client.calls.acquire(timeout=5)
        assert thread._backoff == 4 and thread.rejection is None  # busy is not a rejection: it keeps trying
    finally:
        stop.set()
        thread.beat_now()
        thread.join(timeout=5)


def test_a_heartbeats_answer_names_only_its_own_place_in_the_round_however_many_take_part() -> None:
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig(rounds=RoundConfig(min_peers=40)))
    peers = [engine_join(engine)[0].peer_id for _ in range(40)]

    def ready(peer_id: str) -> pb.RoundInfo:
        return engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=peer_id,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY,
                    state_round=0,
                    state_hash=engine.run.initial_hash,
                    dht_peer_id="dht-" + peer_id,
                ),
            )
        )

    for p in peers:
        ready(p)
    full = engine.round_info(peers[0], 0)
    assert full.open_round == 1 and sorted(full.participants) == sorted(peers)
    mine = ready(peers[7])
    assert mine.open_round == 1 and list(mine.participants) == [peers[7]]
    place = list(full.participants).index(peers[7])
    assert list(mine.participant_dht_ids) == [full.participant_dht_ids[place]]
    assert [p.peer_id for p in mine.plan.peers] in ([], [peers[7]])
    assert mine.ByteSize() < 1000 < full.ByteSize()  # 16 holders at most, and its own entries
